"""Built-in decoding strategies."""

from mlxr_core.plugins import hookimpl

#: Plain decoding is every model's default: this plugin cannot be disabled.
MLXR_ESSENTIAL = True


@hookimpl
def mlxr_register_decoders(register):  # type: ignore[no-untyped-def]
    register("plain", "mlxr_plugins.decoders.plain:PlainDecoder")
