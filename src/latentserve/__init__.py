"""latentserve: a serving engine for latent-reasoning language models.

``from latentserve import LLM, SamplingParams`` gives the offline API (shaped like vLLM's,
with its ``TextPrompt``/``TokensPrompt`` prompt dicts and ``Logprob`` entries).
Heavy modules load lazily so ``import latentserve`` stays cheap.
"""

from latentserve.inputs import TextPrompt, TokensPrompt
from latentserve.outputs import CompletionOutput, Logprob, RequestOutput
from latentserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "TextPrompt", "TokensPrompt", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from latentserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
