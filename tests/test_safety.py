"""Safety of a run: no secret in a run folder or the printed config, weights only as safetensors, no code run from a
pickle or a Hub repository unless asked, files readable as the umask says, no meaningless warnings on stderr."""

from __future__ import annotations

import ast
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST, ROOT

SECRETS = {"WANDB_API_KEY": "secret-xyz-0123456789abcdef0123456789abcdef", "HF_TOKEN": "hf_secret_token_42",
           "HUGGING_FACE_HUB_TOKEN": "hf_secret_token_43"}


def _train(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HYDRA_FULL_ERROR": "0", **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, preexec_fn=lambda: os.umask(0o022))


@pytest.fixture(scope="module")
def secret_run(tmp_path_factory):
    """A two-step run with API keys and tokens in its environment: (run folder, finished process)."""
    run_dir = tmp_path_factory.mktemp("secret-run") / "run"
    out = _train(*FAST, "train.max_steps=2", "train.eval_at_start=false", "hardware=cpu", "logger=jsonl",
                 f"hydra.run.dir={run_dir}", env=SECRETS)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir, out


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_no_secret_from_the_environment_reaches_the_run_folder_or_the_output(secret_run):
    run_dir, out = secret_run
    files = _files(run_dir)
    assert any(p.name == "config.yaml" for p in files) and any(p.name == "metrics.jsonl" for p in files)
    for path in files:
        data = path.read_bytes()
        for name, value in SECRETS.items():
            assert value.encode() not in data, f"{name} found in {path}"
    for value in SECRETS.values():
        assert value not in out.stdout and value not in out.stderr


def test_the_printed_config_holds_no_secret():
    out = _train("--cfg", "all", "logger=wandb", "model=gpt2", env=SECRETS)  # the job's config and Hydra's
    assert out.returncode == 0, out.stderr[-2000:]
    assert "_target_: rlhf.telemetry.loggers.WandbLogger" in out.stdout and "hydra:" in out.stdout
    for value in SECRETS.values():
        assert value not in out.stdout and value not in out.stderr


def test_the_final_model_is_safetensors_only(secret_run):
    run_dir, _ = secret_run
    names = {p.name for p in (run_dir / "final").iterdir()}
    assert "model.safetensors" in names
    assert not {n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))}, names


def test_a_plain_run_prints_no_bitsandbytes_kernels_notice(secret_run):
    _, out = secret_run
    assert "kernels-community" not in out.stderr and "pip install kernels" not in out.stderr


def test_the_bitsandbytes_kernels_notice_is_silenced_at_its_source():
    """bitsandbytes warns only on CPUs with AVX512-BF16; re-run its CPU backend as if on one, without rlhf and then
    with it imported: the notice shows before, and not after (other warnings of that logger still do)."""
    script = """
import importlib, logging, sys
import bitsandbytes.functional as functional
import bitsandbytes.backends.cpu.ops as ops
functional.has_avx512bf16 = lambda: True
def backend_import():
    try:
        importlib.reload(ops)
    except Exception:  # the reload re-registers kernels; only its warning matters here
        pass
backend_import()
print("--- rlhf imported ---", file=sys.stderr, flush=True)
import rlhf
backend_import()
logging.getLogger("bitsandbytes.backends.cpu.ops").warning("another bitsandbytes warning")
"""
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = out.stderr.split("--- rlhf imported ---")
    assert "Failed to load CPU gemm_4bit_forward from kernels-community" in before  # the check can fail
    assert "kernels-community" not in after
    assert "another bitsandbytes warning" in after


def test_every_torch_load_in_the_package_reads_weights_only():
    """A pickle runs code when it is loaded: every ``torch.load`` call in rlhf/ must pass ``weights_only=True``."""
    for path in (ROOT / "rlhf").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                weights_only = {k.arg: k.value for k in node.keywords}.get("weights_only")
                assert isinstance(weights_only, ast.Constant) and weights_only.value is True, \
                    f"{path.relative_to(ROOT)}:{node.lineno}: torch.load without weights_only=True"


def test_no_config_or_module_turns_on_trust_remote_code():
    for path in [*(ROOT / "conf").rglob("*.yaml"), *(ROOT / "rlhf").rglob("*.py")]:
        text = path.read_text()
        assert not re.search(r"trust_remote_code\s*[:=]\s*(true|True)", text), path


# ---- permissions --------------------------------------------------------------------------------------------------
@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_use_umask_gives_library_written_files_the_usual_modes(tmp_path, umask_022):
    import tempfile

    from rlhf.core.file_io import current_umask, use_umask
    from rlhf.embedded.tiny_model import TinySpec

    assert current_umask() == 0o022
    staging = Path(tempfile.mkdtemp(dir=tmp_path))  # 0700, as mkdtemp makes it
    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    policy.model.save_pretrained(staging)  # safetensors writes 0600
    policy.tokenizer.save_pretrained(staging)
    (staging / "sub").mkdir(mode=0o700)
    (staging / "link").symlink_to(staging / "config.json")
    use_umask(staging)
    assert _mode(staging) == 0o755 and _mode(staging / "sub") == 0o755
    assert _mode(staging / "model.safetensors") == 0o644 and _mode(staging / "config.json") == 0o644


def test_use_umask_follows_a_stricter_umask(tmp_path):
    from rlhf.core.file_io import use_umask

    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "weights").write_text("x")
    old = os.umask(0o077)
    try:
        use_umask(tmp_path / "folder")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "folder") == 0o700 and _mode(tmp_path / "folder" / "weights") == 0o600


def test_a_runs_final_model_is_readable_as_the_umask_says(secret_run):
    run_dir, _ = secret_run  # run under umask 022
    for path in (run_dir / "final").iterdir():
        assert _mode(path) == 0o644, (path.name, oct(_mode(path)))
    assert _mode(run_dir / "final") == 0o755


def test_the_tiny_models_warm_start_cache_is_readable_as_the_umask_says(tmp_path, umask_022):
    from rlhf.embedded.tiny_model import TinySpec

    TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=1,
             warm_start_batch_size=2, cache_dir=str(tmp_path)).build()
    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith("tiny-")]
    assert _mode(folder) == 0o755
    for path in folder.iterdir():
        assert _mode(path) == 0o644, (path.name, oct(_mode(path)))
