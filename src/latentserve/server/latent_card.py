"""What ``/v1/models`` says of a served model's latent reasoning (the ``latent`` key of its
card), so a client (the viewer, ``server/viewer/``) shows only the controls the model takes.
Design notes: docs/internals.md, "latentserve.server.latent_card"."""

from __future__ import annotations

_TRACED = ("feedback", "head", "recurrent", "loop")
_STREAMED = ("feedback", "head", "loop")
# The exit fields each recurrent family takes (Ouro exits by its gate: no min steps, no check
# interval, no exit semantics; latent/recurrent.py ``resolve_exit_rule`` refuses them).
_EXIT_FIELDS = {"huginn": ("exit_criterion", "exit_threshold", "exit_min_steps",
                           "exit_check_every", "exit_semantics"),
                "ouro": ("exit_criterion", "exit_threshold")}


def latent_card(spec) -> dict | None:
    """The card's ``latent`` object for a ``LatentSpec`` (None: a plain model)."""
    if spec is None:
        return None
    # NOTE: torch (latent.recurrent): only a latent model's card loads it
    from latentserve.latent.recurrent import HUGINN_AUTO_THRESHOLDS, OURO_CRITERIA

    kind = spec.kind
    controls = list(spec.controls) if kind == "head" else ["latent_budget"]
    if kind == "feedback":  # thinking off: no latent step (a looped block refuses it)
        controls.append("thinking")
    if "max_latent" in controls:  # a head takes latent_budget (and its header) as max_latent
        controls.insert(controls.index("max_latent") + 1, "latent_budget")
    criteria = None
    if kind == "recurrent":
        controls += _EXIT_FIELDS[spec.family]
        criteria = (list(OURO_CRITERIA) if spec.family == "ouro"
                    else [*HUGINN_AUTO_THRESHOLDS, "none"])
    if spec.upstream_eos_from:
        controls.append("upstream_stop_rules")
    budget = None if kind == "head" else {"default": spec.default_budget,
                                          "min": spec.min_budget, "max": spec.max_budget}
    return {"kind": kind, "family": spec.family, "controls": controls, "budget": budget,
            "max_compression_factor": spec.max_compression_factor or None,
            "exit_criteria": criteria, "block_size": spec.block_size or None,
            "return_latent_trace": kind in _TRACED, "stream_latent_steps": kind in _STREAMED}
