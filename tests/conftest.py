"""Shared fixtures: tiny real models (built here, no hub), temporary caches, seeds.

Markers (pyproject.toml): slow, real (SmolLM2/ShareGPT), vllm, crash, crashloop, gpu.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
sys.path.insert(0, str(TESTS_DIR))

from tiny import (  # noqa: E402
    add_stop_bias,
    build_tiny_causal_lm,
    build_tiny_gemma4,
    build_tiny_gpt_oss,
    build_tiny_llama4,
    build_tiny_model,
    build_tiny_phi3,
    build_tiny_qwen3,
    build_tiny_qwen3_hybrid,
)

try:  # property-based tests draw the same examples every run, so CI is repeatable (HYPOTHESIS_PROFILE=explore varies them)
    from hypothesis import settings

    settings.register_profile("repeatable", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))
except ImportError:  # the vLLM env may lack hypothesis; its tests do not use it
    pass

# A shell starts a background job (`make test &`, `nohup ... &`) with Ctrl-C ignored, and the CLI subprocesses the
# tests start would inherit that: the signal tests send SIGINT and expect Python's own handling, as in a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Under pytest-xdist the workers share the cores, and torch's OpenMP threads spin-wait on siblings the other worker's
# work has descheduled: an in-process `generate` test took 14 s alone, 184 s beside one busy 2-thread process, 17 s
# with one thread (2-core AMD EPYC). So each worker, and the CLI subprocesses it starts, computes on one thread, and
# vLLM's CPU engines, which bind their OpenMP threads to every core unless told otherwise, get the worker's own
# share of the cores (worker i: every n-th core from the i-th).
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    _worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    _cores = sorted(os.sched_getaffinity(0))
    _share = _cores[_worker % _XDIST_WORKERS :: _XDIST_WORKERS] or _cores
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, _share)))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Build (once per session and argument set) a tiny random Llama with a chat template; returns its dir."""
    built: dict[tuple, Path] = {}

    def make(
        template: str = "chatml",
        num_layers: int = 6,
        hidden_size: int = 64,
        vocab_size: int = 512,
        seed: int = 0,
        dtype: str = "bfloat16",
    ) -> Path:
        key = (template, num_layers, hidden_size, vocab_size, seed, dtype)
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{template}-{num_layers}l")
            built[key] = build_tiny_model(out, template, num_layers, hidden_size, vocab_size, seed, dtype)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory) -> Path:
    """The default tiny model: ChatML template, 6 layers, hidden 64, vocab 512 (tokenizer 400)."""
    return tiny_model_factory()


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """A tiny random Qwen3ForCausalLM (QK-norm, 4 layers, hidden 64, fp32) with Qwen3's real chat template."""
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen3_yarn(tmp_path_factory) -> Path:
    """The tiny Qwen3 with YaRN RoPE (Qwen3's long-context setting), from an original context of 32 positions x 8:
    prompts and replies run past 32, so the interpolated frequencies and the attention factor both matter."""
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-yarn"), rope_parameters=yarn)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    """The tiny Qwen3 as a mixture of experts (Qwen3MoeForCausalLM: 4 experts, 2 per token), fp32."""
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-moe"), moe=True)


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory) -> Path:
    """A tiny random Qwen3NextForCausalLM (linear attention, then gated full attention with partial rotary;
    mixture-of-experts MLPs), fp32, with Qwen3's chat template."""
    return build_tiny_qwen3_hybrid(tmp_path_factory.mktemp("tiny-qwen3-next"), "qwen3_next")


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory) -> Path:
    """A tiny random Qwen3.5 as it ships: a multimodal checkpoint whose language model is a Qwen3-Next-style hybrid
    with dense MLPs, fp32, with Qwen3's chat template."""
    return build_tiny_qwen3_hybrid(tmp_path_factory.mktemp("tiny-qwen3-5"), "qwen3_5")


@pytest.fixture(scope="session")
def tiny_gemma4(tmp_path_factory) -> Path:
    """A tiny random Gemma4ForCausalLM (gelu, norms around attention and MLP, a RoPE per layer type, soft-capped
    logits), fp32, with the chatml tokenizer."""
    return build_tiny_gemma4(tmp_path_factory.mktemp("tiny-gemma4"))


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory) -> Path:
    """A tiny random GptOssForCausalLM (mixture of experts, attention biases and sinks, YaRN RoPE as gpt-oss sets
    it), fp32, with the chatml tokenizer."""
    return build_tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss"))


@pytest.fixture(scope="session")
def tiny_granite(tmp_path_factory) -> Path:
    """A tiny random GraniteForCausalLM with Granite 3's kind of multipliers (embeddings x 12, attention scores x
    0.05, residual branches x 0.22, logits / 16), fp32, with the chatml tokenizer."""
    multipliers = dict(
        embedding_multiplier=12.0, attention_multiplier=0.05, residual_multiplier=0.22, logits_scaling=16.0
    )
    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-granite"), "granite", **multipliers)


@pytest.fixture(scope="session")
def tiny_llama4(tmp_path_factory) -> Path:
    """A tiny random Llama4ForCausalLM (mixture-of-experts MLPs, chunked attention with QK-norm, the last layer
    without RoPE), fp32, with the chatml tokenizer."""
    return build_tiny_llama4(tmp_path_factory.mktemp("tiny-llama4"))


@pytest.fixture(scope="session")
def tiny_phi3_longrope(tmp_path_factory) -> Path:
    """A tiny random Phi3ForCausalLM (fused projections) with LongRoPE over three quarters of each head, as Phi-4-mini
    sets it, from an original context of 32 positions x 8; fp32, with the chatml tokenizer."""
    return build_tiny_phi3(tmp_path_factory.mktemp("tiny-phi3-longrope"))


@pytest.fixture(scope="session")
def tiny_stop_model(tmp_path_factory) -> Path:
    """The default tiny model made to end its replies with <|im_end|> (see tiny.add_stop_bias): sampled replies
    mix stops, empty replies and replies that run to the token limit; greedy replies are empty."""
    out = tmp_path_factory.mktemp("tiny-stop")
    return add_stop_bias(build_tiny_model(out, "chatml", dtype="float32"))


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for CLI subprocesses: this interpreter's scripts first, no debug tracebacks."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("PEAGLE_DEBUG", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class S3Server:
    """A real S3 endpoint on localhost: moto in server mode, run as a subprocess (state in its memory)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        # moto accepts any credentials; these fake ones keep the tests away from the user's real ones.
        self.env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
        }
        self._buckets = 0

    @staticmethod
    def closed_endpoint() -> str:
        """An endpoint URL nothing listens on (a free localhost port)."""
        return f"http://127.0.0.1:{_free_port()}"

    def bucket(self, name: str = "peagle") -> str:
        """A new, empty bucket; returns its name."""
        import fsspec

        self._buckets += 1
        bucket = f"{name}-{self._buckets}"
        fsspec.filesystem("s3", endpoint_url=self.endpoint, skip_instance_cache=True).mkdir(bucket)
        return bucket


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc, timeout: float = 30.0) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto server did not start (exit {proc.poll()})") from None
            time.sleep(0.1)


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on a free localhost port for the session (as s3fs's own tests run it); its AWS_*
    variables are set in this process too, so in-process readers (open_cache("s3://...")) reach it."""
    import subprocess

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = S3Server(port)
    saved = {k: os.environ.get(k) for k in server.env}
    try:
        _wait_http(server.endpoint + "/moto-api/", proc)
        os.environ.update(server.env)
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.kill()
        proc.wait()
