"""Ollama's model creation over served models: LoRA adapters created and deleted while serving.

``ollama create`` (and the Python client's ``create_blob`` + ``create``) uploads each file of an
adapter as a blob (``POST /api/blobs/sha256:<hex>``, the body's SHA-256 checked), then sends
``POST /api/create`` with ``from`` (a served model) and ``adapters`` (file name -> blob digest): a
llama.cpp LoRA GGUF, or a PEFT / mlx-lm folder's ``adapter_config.json`` and safetensors file.
The adapter is read, checked against the model (a tensor that does not fit is a 400 naming it)
and served as a model of its own under the new name (:mod:`mlxr_core.engine.created_adapters`);
``/api/tags`` lists it with ``details.parent_model``, and ``DELETE /api/delete`` stops serving
it. Ollama before 0.5.5 sent a ``modelfile`` instead: its ``FROM`` and ``ADAPTER <path>`` lines
(a path on the server) are read the same way.

Everything else ``/api/create`` can do (a model from weight files, quantizing, a template, a
system prompt, parameters, messages) is refused naming the field: the model is the served one.
The model the adapter goes over needs ``models[].adapters`` or ``models[].runtime_adapters``.
Every route here changes what the server serves: an admin key where ``server.admin_api_keys`` is
set (:func:`~mlxr_core.http.access.admin_access`). Blobs live under the data folder
(:func:`~mlxr_core.model.paths.data_dir`, ``blobs/``), created adapters' files under ``adapters/``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, delete, head, post
from litestar.params import JSONBody, Parameter
from msgspec import UNSET, Meta, Struct, UnsetType

from mlxr_core.engine.client import EngineClient
from mlxr_core.errors import (
    MlxrError,
    ModelLoadError,
    ModelNotFound,
    ModelUnavailable,
    RequestError,
    UnsupportedFormat,
)
from mlxr_core.http.access import admin_access
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import json_response, ready_engine
from mlxr_core.model.paths import data_dir
from mlxr_plugins.apis.ollama import schemas as s
from mlxr_plugins.apis.ollama.routes import ERRORS, served_name

#: ``sha256:<64 hex>`` (Ollama's ``sha256-<hex>`` file spelling is accepted too).
DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
#: A blob's digest in a route's path.
BlobDigest = Annotated[str, Parameter(pattern=DIGEST.pattern)]
#: A file name inside an adapter: no folders, nothing hidden.
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
#: The largest blob taken (an adapter of a large model at a high rank is a few GB).
MAX_BLOB_BYTES = 16 * 2**30
#: ``/api/create`` fields that would make a model of its own rather than an adapter over one.
UNSUPPORTED_FIELDS = ("files", "quantize", "template", "system", "parameters", "messages")
#: Modelfile instructions (``FROM``, ``ADAPTER``) and those that would change the model.
INSTRUCTION = re.compile(r"^\s*([A-Za-z]+)\s+(.*?)\s*$")


#: A field this server cannot honour, stated: only empty (``{}``, ``[]``, ``""``) or null.
NONE_TEXT = Meta(extra_json_schema={"maxLength": 0, "description": s.UNSUPPORTED})
NONE_OBJECT = Meta(extra_json_schema={"maxProperties": 0, "description": s.UNSUPPORTED})
NONE_LIST = Meta(extra_json_schema={"maxItems": 0, "description": s.UNSUPPORTED})
Name = Annotated[str, Meta(min_length=1, max_length=256)]
#: A file name inside an adapter -> its blob's digest.
AdapterFiles = dict[Annotated[str, Meta(pattern=FILE_NAME.pattern)], Annotated[str, Meta(pattern=DIGEST.pattern)]]


class CreateFields(Struct, forbid_unknown_fields=False):
    """The body of ``/api/create``: the new model's name (``model``, or ``name`` in older
    clients), ``from`` and ``adapters``, or an older client's ``modelfile``."""

    model: Name | UnsetType = UNSET
    name: Name | UnsetType = UNSET
    from_: Name | None = msgspec.field(default=None, name="from")
    #: File name -> the digest of a blob uploaded with ``POST /api/blobs/{digest}``.
    adapters: AdapterFiles | None = None
    #: Ollama before 0.5.5: ``FROM <model>`` and ``ADAPTER <path on the server>`` lines.
    modelfile: Annotated[str, Meta(min_length=1)] | None = None
    files: Annotated[dict[str, str], NONE_OBJECT] | None = None
    quantize: Annotated[str, NONE_TEXT] | None = None
    template: Annotated[str, NONE_TEXT] | None = None
    system: Annotated[str, NONE_TEXT] | None = None
    parameters: Annotated[dict[str, Any], NONE_OBJECT] | None = None
    messages: Annotated[list[Any], NONE_LIST] | None = None
    #: Kept by Ollama for the model's card; nothing here shows it.
    license: str | list[str] | None = None
    stream: bool = True


#: The body of ``/api/create``, its schema stating what the route checks: a name, and ``from``
#: with ``adapters`` or a ``modelfile``.
CreateRequest = Annotated[CreateFields, Meta(extra_json_schema={"allOf": [
    {"anyOf": [{"required": ["model"]}, {"required": ["name"]}]},
    {"anyOf": [
        {"required": ["modelfile"], "properties": {"modelfile": {"type": "string"}}},
        {"required": ["from", "adapters"], "properties": {"from": {"type": "string"}, "adapters": {"type": "object", "minProperties": 1}}},
    ]},
]})]  # fmt: skip


class CreateStatus(Struct):
    status: str


def create_routes(ctx: ServerContext) -> list[Any]:
    """The blob, create and delete routes of the Ollama router."""
    admin = admin_access(ctx.config.server)

    @head("/blobs/{digest:str}", guards=[admin], operation_class=ERRORS, summary="Whether a blob is uploaded")
    async def blob_exists(digest: BlobDigest) -> None:
        if not blob_path(digest).is_file():
            raise BlobNotFound(f"blob {digest} not found")

    @post("/blobs/{digest:str}", guards=[admin], status_code=201, request_max_body_size=MAX_BLOB_BYTES,
          operation_class=ERRORS, summary="Upload a blob (an adapter's file) under its SHA-256 digest")  # fmt: skip
    async def push_blob(digest: BlobDigest, request: Request[Any, Any, Any]) -> Response[None]:
        target = blob_path(digest)
        if target.is_file():
            return Response(None, status_code=200)
        await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{uuid.uuid4().hex}.partial")
        hasher = hashlib.sha256()
        try:
            with partial.open("wb") as out:
                async for chunk in request.stream():
                    hasher.update(chunk)
                    await asyncio.to_thread(out.write, chunk)
            if f"sha256:{hasher.hexdigest()}" != normal_digest(digest):
                raise RequestError(f"the body's digest is sha256:{hasher.hexdigest()}, not {digest}", field="digest")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return Response(None, status_code=201)

    @post("/create", status_code=200, guards=[admin], operation_class=ERRORS,
          summary="Serve a LoRA adapter over a served model as a model of its own")  # fmt: skip
    async def create(data: JSONBody[CreateRequest]) -> Response[Any]:
        engine = ready_engine(ctx)
        name, base, files, local = creation_plan(engine, data)
        path = local if local is not None else await asyncio.to_thread(assemble, name, files)
        await _run(ctx, engine.create_adapter(base, name, str(path)), f"creating {name}")
        steps = [f"reading adapter {Path(path).name}", f"loading adapter over {base}", "success"]
        if not data.stream:
            return json_response(CreateStatus("success"))
        lines = b"".join(s.encoder.encode(CreateStatus(step)) + b"\n" for step in steps)
        return Response(lines, media_type="application/x-ndjson")

    @delete("/delete", status_code=200, guards=[admin], operation_class=ERRORS,
            summary="Stop serving a LoRA adapter created with /api/create")  # fmt: skip
    async def delete_model(data: JSONBody[s.ShowRequest]) -> None:
        engine = ready_engine(ctx)
        name = tagless(data.model_name)
        if not created(engine, name):
            served_name(engine, data.model_name)  # 404 for a name nothing serves
            raise RequestError(f"{data.model_name!r} is served from the server's config; only adapters created "
                               "with /api/create are deleted here", field="model")  # fmt: skip
        await _run(ctx, engine.create_adapter(engine.adapters[name][0], name, None), f"deleting {name}")

    return [blob_exists, push_blob, create, delete_model]


class BlobNotFound(MlxrError):
    status = 404


def normal_digest(digest: str) -> str:
    """``sha256:<hex>``; a 400 naming ``digest`` for anything else."""
    match = DIGEST.match(digest)
    if match is None:
        raise RequestError(f"{digest[:80]!r} is not a digest: expected sha256:<64 hex digits>", field="digest")
    return f"sha256:{match.group(1)}"


def blob_path(digest: str) -> Path:
    return data_dir() / "blobs" / normal_digest(digest).replace(":", "-")


def tagless(name: str) -> str:
    """Ollama's default tag ``:latest`` left out: ``pirate:latest`` is served as ``pirate``."""
    return name.removesuffix(":latest")


def created(engine: EngineClient, name: str) -> bool:
    """Whether ``name`` is an adapter created while serving (its adapter's name is the served
    name; a configured adapter is served as ``<model>:<adapter>``)."""
    adapter = engine.adapters.get(name)
    return adapter is not None and adapter[1] == name


def serves(engine: EngineClient, name: str) -> bool:
    try:
        engine.resolve(name)
    except ModelNotFound:
        return False
    return True


def creation_plan(engine: EngineClient, body: CreateFields) -> tuple[str, str, dict[str, str], str | None]:
    """The new model's name, the served model it goes over, and its files (name -> blob digest),
    or the path on the server an older client's ``ADAPTER`` line names; 400s naming the field."""
    for field in UNSUPPORTED_FIELDS:
        if getattr(body, field) not in (None, {}, [], ""):
            raise RequestError(f"{field} is not supported by this server: /api/create serves a LoRA adapter "
                               "over a served model (from + adapters)", field=field)  # fmt: skip
    raw = body.name if isinstance(body.model, UnsetType) else body.model
    if isinstance(raw, UnsetType):
        raise RequestError("model is required (the new model's name)", field="model")
    name = tagless(raw)
    source, files, local = body.from_, dict(body.adapters or {}), None
    if body.modelfile is not None:
        source, local = read_modelfile(body.modelfile, source)
    if not source:
        raise RequestError("from is required (or a FROM line in the Modelfile): the served model the "
                           "adapter goes over", field="from")  # fmt: skip
    base = served_name(engine, source)
    if source in engine.adapters or tagless(source) in engine.adapters:
        raise RequestError(f"{source!r} is an adapter; an adapter goes over a served model", field="from")
    if serves(engine, name) and not (created(engine, name) and engine.adapters[name][0] == base):
        raise RequestError(f"{name!r} already names a served model", field="model")
    if local is None and not files:
        raise RequestError("adapters is required (file name -> blob digest): only LoRA adapters over a "
                           "served model are created here", field="adapters")  # fmt: skip
    for file, digest in files.items():
        if not blob_path(digest).is_file():
            raise RequestError(f"blob {digest} not found: upload it first (POST /api/blobs/{digest})",
                               field=f"adapters.{file}")  # fmt: skip
    return name, base, files, local


def read_modelfile(text: str, source: str | None) -> tuple[str | None, str]:
    """``FROM`` and the one ``ADAPTER`` path of an older client's Modelfile; a 400 naming the
    instruction this server does not take (``PARAMETER``, ``TEMPLATE``, ``SYSTEM`` ...)."""
    adapters = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = INSTRUCTION.match(line)
        if match is None:
            raise RequestError(f"cannot read the Modelfile line {line.strip()[:80]!r}", field="modelfile")
        instruction, value = match.group(1).upper(), match.group(2).strip("\"'")
        if instruction == "FROM":
            source = value
        elif instruction == "ADAPTER":
            adapters.append(value)
        else:
            raise RequestError(f"{instruction} is not supported by this server: a Modelfile here has FROM and "
                               "ADAPTER lines", field="modelfile")  # fmt: skip
    if len(adapters) != 1:
        raise RequestError(f"the Modelfile has {len(adapters)} ADAPTER lines; one is served", field="modelfile")
    path = Path(adapters[0]).expanduser()
    if not path.is_absolute() or not path.exists():
        raise RequestError(f"the Modelfile's ADAPTER {adapters[0][:200]!r}: no such file or folder on the "
                           "server (give its absolute path)", field="modelfile")  # fmt: skip
    return source, str(path)


def assemble(name: str, files: dict[str, str]) -> Path:
    """The adapter's files (their blobs, linked under their names) in a folder of their own under
    the data folder; a lone GGUF file is the adapter itself."""
    key = hashlib.sha256(json.dumps([name, sorted(files.items())]).encode()).hexdigest()[:24]
    folder = data_dir() / "adapters" / key
    folder.mkdir(parents=True, exist_ok=True)
    for file, digest in files.items():
        link = folder / file
        if not link.is_symlink():
            link.symlink_to(blob_path(digest))
    only = next(iter(files)) if len(files) == 1 else ""
    return folder / only if only.endswith(".gguf") else folder


async def _run(ctx: ServerContext, job: Any, what: str) -> bool:
    """Wait for an adapter's creation or deletion on the engine; a refused adapter is a 400 with
    the engine's reason (the tensor that does not fit)."""
    try:
        return bool(await asyncio.wait_for(asyncio.wrap_future(job), ctx.config.engine.model_load_wait_s))
    except TimeoutError:
        raise ModelUnavailable(f"{what} did not finish within engine.model_load_wait_s "
                               f"({ctx.config.engine.model_load_wait_s:g} s); retry") from None  # fmt: skip
    except (ModelLoadError, UnsupportedFormat) as exc:
        raise RequestError(exc.message, field="adapters") from None
