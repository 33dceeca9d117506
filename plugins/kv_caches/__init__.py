"""Built-in KV cache methods (``models[].kv_cache.method``): ``affine``, keys and values quantized
in groups (:mod:`mlxr_core.model.quantized_cache`), and ``turboquant``, rotated coordinates on
Lloyd-Max codebooks with a 1-bit sign sketch of the keys' residuals
(:mod:`mlxr_plugins.kv_caches.turboquant`)."""

from mlxr_core.plugin_api import hookimpl


@hookimpl
def mlxr_register_kv_caches(register):  # type: ignore[no-untyped-def]
    register("affine", "mlxr_core.model.quantized_cache:AffineMethod")
    register("turboquant", "mlxr_plugins.kv_caches.turboquant:TurboQuantMethod")
    register("turboquant_mse", "mlxr_plugins.kv_caches.turboquant:TurboQuantMSEMethod")
