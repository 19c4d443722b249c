"""The recurrent-depth exit criteria by name (Huginn-0125, arXiv 2502.05171; Ouro, arXiv
2510.25741), light (no torch) so the CLI can offer them as choices at parse time. Which
criterion a given model takes is ``latent.recurrent.exit_rule``'s check."""

# Huginn exit criteria and their "auto" thresholds (upstream raven_modeling_minimal.py,
# get_adaptive_exit_evaluator). "none" never exits.
HUGINN_AUTO_THRESHOLDS = {"entropy-diff": 1e-3, "latent-diff": 0.03, "kl": 1e-3,
                          "minp-kl": 1e-5, "argmax-stability": 5, "cosine": 1e-3}
# Ouro readouts (upstream modeling_ouro.py, OuroForCausalLM.forward): "last" step,
# "threshold" (first step whose cumulative exit probability reaches the threshold),
# "weighted" (exit-probability mixture), and our compute-saving "threshold-approx".
OURO_CRITERIA = ("last", "threshold", "weighted", "threshold-approx")
# Every name some recurrent model takes: the CLI's --exit-criterion choices.
EXIT_CRITERIA = (*HUGINN_AUTO_THRESHOLDS, "none", *OURO_CRITERIA)
