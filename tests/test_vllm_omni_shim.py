"""omni-pd's opt-in `vllm_omni` shim: what it writes, what it refuses, how it reads `vllm serve`
arguments. (The live `vllm serve --omni` run is in e2e/test_vllm_serve_omni.py.)"""

from __future__ import annotations

import sys

import pytest

from omni_pd.entrypoints import vllm_omni_shim as shim
from omni_pd.entrypoints.cli import main as cli_main
from omni_pd.entrypoints.cli import run_vllm_command as cli_run_vllm_command


def test_install_status_uninstall_round_trip(tmp_path, capsys):
    assert cli_main(["vllm-shim", "install", "--target", str(tmp_path)]) == 0
    package = tmp_path / "vllm_omni"
    assert shim.is_shim(package)
    assert (package / "entrypoints" / "cli" / "main.py").read_text().count("run_vllm_command") == 2
    assert shim.status(tmp_path).endswith("omni-pd's shim")
    main_py = package / "entrypoints" / "cli" / "main.py"
    main_py.write_text(main_py.read_text().replace("entrypoints.cli", "entrypoints.vllm_omni_shim"))
    assert "another omni-pd version" in shim.status(tmp_path)  # a shim an older omni-pd wrote
    assert cli_main(["vllm-shim", "install", "--target", str(tmp_path)]) == 0  # idempotent
    assert shim.status(tmp_path).endswith("omni-pd's shim")
    assert cli_main(["vllm-shim", "uninstall", "--target", str(tmp_path)]) == 0
    assert not package.exists()
    assert "not installed" in shim.status(tmp_path)
    assert shim.uninstall(tmp_path) is None


def test_never_touches_a_real_vllm_omni_in_the_target(tmp_path, capsys):
    real = tmp_path / "vllm_omni"
    real.mkdir()
    (real / "__init__.py").write_text("# vllm-omni itself\n")
    assert cli_main(["vllm-shim", "install", "--target", str(tmp_path)]) == 2
    assert "did not write" in capsys.readouterr().err
    assert (real / "__init__.py").read_text() == "# vllm-omni itself\n"
    with pytest.raises(shim.ShimError, match="not omni-pd's shim"):
        shim.uninstall(tmp_path)
    assert real.exists()


def test_refuses_when_vllm_omni_is_importable_elsewhere(tmp_path, monkeypatch):
    elsewhere = tmp_path / "site"
    (elsewhere / "vllm_omni").mkdir(parents=True)
    (elsewhere / "vllm_omni" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(elsewhere))
    monkeypatch.delitem(sys.modules, "vllm_omni", raising=False)
    target = tmp_path / "target"
    with pytest.raises(shim.ShimError, match="importable from"):
        shim.install(target)
    assert not (target / "vllm_omni").exists()
    assert "not omni-pd's" in shim.status(target)


def test_translates_vllm_serve_arguments():
    got = shim.translate_vllm_argv(
        [
            "serve",
            "/models/q",
            "--omni",
            "--stage-configs-path",
            "p.yaml",
            "--host",
            "0.0.0.0",
            "--port",
            "8091",
            "--served-model-name",
            "omni",
            "--uvicorn-log-level",
            "warning",
        ]
    )
    assert got == [
        "--log-level",
        "WARNING",
        "serve",
        "/models/q",
        "--stage-configs-path",
        "p.yaml",
        "--host",
        "0.0.0.0",
        "--port",
        "8091",
        "--served-model-name",
        "omni",
        *shim.VLLM_OMNI_ANSWERS,
    ]
    assert shim.translate_vllm_argv(["serve", "--omni", "--model", "m"]) == [
        "--log-level",
        "INFO",
        "serve",
        "m",
        *shim.VLLM_OMNI_ANSWERS,
    ]
    # vllm-omni 0.30's deploy schema passes through as omni-pd's --deploy-config.
    assert shim.translate_vllm_argv(["serve", "m", "--omni", "--deploy-config", "d.yaml"]) == [
        "--log-level",
        "INFO",
        "serve",
        "m",
        "--deploy-config",
        "d.yaml",
        *shim.VLLM_OMNI_ANSWERS,
    ]


def test_deploy_config_reaches_the_server(monkeypatch):
    seen = {}

    def fake_serve(args):
        seen.update(stage_configs_path=args.stage_configs_path, deploy_config=args.deploy_config)
        return 0

    monkeypatch.setattr("omni_pd.entrypoints.cli._cmd_serve", fake_serve)
    with pytest.raises(SystemExit) as exit_:
        cli_run_vllm_command(["serve", "tiny-qwen3-omni", "--omni", "--deploy-config", "d.yaml"])
    assert exit_.value.code == 0
    assert seen == {"stage_configs_path": None, "deploy_config": "d.yaml"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["chat", "--omni"], "vllm serve MODEL --omni"),
        (["serve", "m", "--omni", "--max-model-len", "4096"], "--max-model-len 4096"),
        (["serve", "a", "--omni", "--model", "b"], "two models"),
        (["serve", "m", "--omni", "--uvicorn-log-level", "trace"], "--uvicorn-log-level"),
        (["serve", "m", "--omni", "--stage-configs-path", "a", "--deploy-config", "b"], "not both"),
    ],
)
def test_arguments_it_cannot_honour_are_refused_by_name(argv, message, capsys):
    with pytest.raises(shim.ShimError, match=message.replace("-", r"\-")):
        shim.translate_vllm_argv(argv)
    with pytest.raises(SystemExit) as exit_:
        cli_run_vllm_command(argv)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err
