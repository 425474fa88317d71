"""The peer CLI's flag set is pinned here so it does not sprawl; config files and bad flags behave."""

import subprocess
import sys

import pytest

from ravnest_p2p.peer import build_parser, config_from_args
from ravnest_p2p.utils.aio import load_stretch


def start_s() -> float:
    """How long a `python -m ravnest_p2p.peer` that fails on its arguments may take: its imports (torch,
    hivemind) took 22 s of wall time for 2.4 s of CPU at load 12 on 2 cores."""
    return 60 * load_stretch()


PINNED_FLAGS = {
    "--initial-peers",
    "--identity-path",
    "--host-maddrs",
    "--announce-maddrs",
    "--run-id",
    "--run-owner",
    "--device",
    "--max-memory-gb",
    "--use-relay",
    "--no-use-relay",
    "--use-auto-relay",
    "--client-mode",
    "--config",
    "--log-level",
    "--help",
    "-h",
}


def test_flag_set_is_pinned():
    flags = {opt for action in build_parser()._actions for opt in action.option_strings}
    assert flags == PINNED_FLAGS


def test_flags_fill_the_config():
    config, level = config_from_args(
        [
            "--initial-peers",
            "/ip4/127.0.0.1/tcp/1/p2p/QmA",
            "--initial-peers",
            "/ip4/127.0.0.1/tcp/2/p2p/QmB",
            "--run-id",
            "exp1",
            "--max-memory-gb",
            "3.5",
            "--no-use-relay",
            "--client-mode",
            "--log-level",
            "DEBUG",
        ]
    )
    assert config.initial_peers == ("/ip4/127.0.0.1/tcp/1/p2p/QmA", "/ip4/127.0.0.1/tcp/2/p2p/QmB")
    assert config.run_id == "exp1"
    assert config.max_memory_gb == 3.5
    assert config.use_relay is False
    assert config.client_mode is True
    assert level == "DEBUG"


def test_defaults():
    config, level = config_from_args([])
    assert config.initial_peers == ()
    assert config.use_relay is True
    assert config.host_maddrs == ("/ip4/127.0.0.1/tcp/0",)
    assert level == "INFO"


def test_config_file_is_read_and_flags_override_it(tmp_path):
    path = tmp_path / "peer.toml"
    path.write_text('run_id = "from-file"\ndevice = "cpu"\nrecord_ttl_s = 20\n[probe]\nperiod_s = 5\n')
    config, _ = config_from_args(["--config", str(path)])
    assert (config.run_id, config.record_ttl_s, config.probe.period_s) == ("from-file", 20, 5)
    config, _ = config_from_args(["--config", str(path), "--run-id", "flag"])
    assert config.run_id == "flag"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--bogus"], "unrecognized arguments"),
        (["--max-memory-gb", "-2"], "greater than 0"),
        (["--max-memory-gb", "lots"], "invalid float"),
        (["--run-id", "bad id!"], "run_id"),
        (["--device", "tpu"], "device"),
        (["--config", "/nonexistent/x.toml"], "cannot read config file"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(argv, needle):
    proc = subprocess.run(
        [sys.executable, "-m", "ravnest_p2p.peer", *argv], capture_output=True, text=True, timeout=start_s()
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0]


@pytest.mark.parametrize("cli", ["peer", "status"])
def test_a_bad_flag_fails_before_the_heavy_imports(cli):
    """A mistyped flag is reported at once: neither torch nor hivemind is imported for it (~3 s)."""
    probe = (
        "import sys\n"
        f"from ravnest_p2p.{cli} import main\n"
        "try:\n"
        "    main(['--bogus'])\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, 'torch' in sys.modules, 'hivemind' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=start_s())
    assert proc.stdout.split() == ["2", "False", "False"], proc.stderr


def test_the_demo_refuses_a_flag_instead_of_running():
    argv = [sys.executable, "-m", "ravnest_p2p.demo", "--bogus"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=start_s())
    assert proc.returncode == 2  # the demo itself would have run for ~30 s and exited 0
    assert "unrecognized arguments: --bogus" in proc.stderr
    assert "starting" not in proc.stdout


def test_unknown_config_file_field_is_rejected(tmp_path):
    path = tmp_path / "peer.toml"
    path.write_text("runid = 'typo'\n")
    proc = subprocess.run(
        [sys.executable, "-m", "ravnest_p2p.peer", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=start_s(),
    )
    assert proc.returncode == 2
    assert "runid" in proc.stderr


def test_public_api_is_pinned():
    import ravnest_p2p

    assert set(ravnest_p2p.__all__) >= {"RavnestError", "__version__"}
