"""Training: text CoT (``cot.py``), CoLaR (``colar.py``, ``colar_grpo.py``) and the
compression head (``sft.py``, ``dagger.py``, ``grpo.py``); their options in ``options.py``.
Light: the CLI imports ``options`` to build its parser."""
