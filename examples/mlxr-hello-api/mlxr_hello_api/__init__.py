"""mlxr-hello-api: an example third-party mlxr plugin.

It adds an HTTP API named ``hello`` (mount it with ``apis: [openai, hello]``) and declares its own
config section, ``plugins.config.hello``. Registration only names ``"module:attr"`` strings, so
``mlxr plugins`` and ``mlxr --help`` never import Litestar through this plugin.
"""

from __future__ import annotations

import attrs
from attrs import validators as v

from mlxr_core.plugin_api import RegisterName, RegisterSection, hookimpl


@attrs.define
class HelloConfig:
    """``plugins.config.hello``: validated strictly by mlxr when the config loads."""

    #: The word ``GET /v1/hello`` greets with.
    greeting: str = attrs.field(default="Hello", validator=v.min_len(1))
    #: Mount ``POST /v1/tokenize`` too.
    tokenize: bool = True


@hookimpl
def mlxr_register_apis(register: RegisterName) -> None:
    register("hello", "mlxr_hello_api.api:make_router")


@hookimpl
def mlxr_config_sections(register: RegisterSection) -> None:
    register(HelloConfig)
