"""Built-in decoding strategies: ``plain``, and the drafting ``prompt_lookup`` and ``speculative``
(configured under ``plugins.config.decoders``; see :mod:`mlxr_plugins.decoders.config`), and
``prediction``, which drafts a request's Predicted Output, ``mtp``, the checkpoint's
multi-token-prediction head, ``eagle3``, an EAGLE-3 draft head, and ``dflash``, a DFlash block
drafter. Those registered with ``drafts=True`` draft inside the batch
(``models[].speculative.method``; :mod:`mlxr_core.engine.speculation`)."""

from mlxr_core.plugin_api import hookimpl
from mlxr_plugins.decoders.config import DecodersConfig

#: Plain decoding is every model's default: this plugin cannot be disabled.
MLXR_ESSENTIAL = True


@hookimpl
def mlxr_register_decoders(register):  # type: ignore[no-untyped-def]
    register("plain", "mlxr_plugins.decoders.plain:PlainDecoder")
    register("prompt_lookup", "mlxr_plugins.decoders.prompt_lookup:PromptLookupDecoder", drafts=True)
    register("prediction", "mlxr_plugins.decoders.prediction:PredictionDecoder", drafts=True)
    register("speculative", "mlxr_plugins.decoders.speculative:SpeculativeDecoder", drafts=True)
    register("mtp", "mlxr_plugins.decoders.mtp:MtpDecoder", drafts=True)
    register("eagle3", "mlxr_plugins.decoders.eagle3:Eagle3Decoder", drafts=True, draft_checkpoint=True)
    register("dflash", "mlxr_plugins.decoders.dflash:DFlashDecoder", drafts=True, draft_checkpoint=True)


@hookimpl
def mlxr_config_sections(register):  # type: ignore[no-untyped-def]
    register(DecodersConfig)
