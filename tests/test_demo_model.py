"""Tests for the shipped demo model, its synthetic corpus and its training script.

The model tests load the committed files in ``logitscope/demo_model/files/``
(no network) and check that the model really learned the corpus structure.
Training is only smoke-tested, for 2 steps on a tiny corpus.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from pathlib import Path

import pytest
import torch

import logitscope.demo_model as demo_model
from logitscope.demo_model import DEMO_MODEL_PATH, load_demo_model
from logitscope.demo_model.corpus import EOT, iter_documents, write_corpus
from logitscope.demo_model.train import main as train_main
from logitscope.demo_model.train import pack_documents, train


@pytest.fixture(scope="module")
def demo():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield load_demo_model()


def _greedy(demo, prompt: str, max_new_tokens: int = 40) -> str:
    """Greedy continuation of ``prompt`` (without the prompt)."""
    model, tokenizer = demo
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


# --- loading -----------------------------------------------------------------


def test_load_demo_model_offline(demo) -> None:
    from transformers import GPT2LMHeadModel

    model, tokenizer = demo
    assert isinstance(model, GPT2LMHeadModel)
    assert not model.training
    assert model.config.model_type == "gpt2"
    assert len(tokenizer) == model.config.vocab_size
    assert model.get_output_embeddings().weight.shape[0] == model.config.vocab_size
    eot = tokenizer.convert_tokens_to_ids(EOT)
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == tokenizer.bos_token_id == eot
    assert model.config.eos_token_id == model.generation_config.eos_token_id == eot
    assert next(model.parameters()).dtype == torch.float32


def test_committed_files_are_small() -> None:
    total = sum(p.stat().st_size for p in DEMO_MODEL_PATH.iterdir() if p.is_file())
    assert (DEMO_MODEL_PATH / "model.safetensors").is_file()
    assert total < 6 * 1024 * 1024


def test_load_demo_model_missing_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    monkeypatch.setattr(demo_model, "DEMO_MODEL_PATH", missing)
    with pytest.raises(FileNotFoundError, match=r"python -m logitscope\.demo_model\.train") as info:
        load_demo_model()
    assert str(missing) in str(info.value)


def test_load_demo_model_dtype() -> None:
    model, _ = load_demo_model(dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="dtype"):
        load_demo_model(dtype="float32")  # type: ignore[arg-type]


# --- tokenizer ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Zoë à Zürich",
        '{"name": "Alice Moreau", "age": 34, "city": "Lyon"}',
        "Call Maria at 555-0134.",
        "  two  spaces,\ttabs\nand newlines \n",
        "日本語 and emoji 🙂",
    ],
)
def test_tokenizer_round_trip(demo, text: str) -> None:
    _, tokenizer = demo
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_adds_no_special_tokens(demo) -> None:
    _, tokenizer = demo
    ids = tokenizer.encode("Call ")
    assert tokenizer.eos_token_id not in ids
    assert tokenizer.encode("A" + EOT)[-1] == tokenizer.eos_token_id


# --- what the model learned --------------------------------------------------


def test_greedy_json_record(demo) -> None:
    prompt = '{"name": "'
    first_line = (prompt + _greedy(demo, prompt)).split("\n")[0]
    record = json.loads(first_line)  # a complete, valid JSON object
    assert set(record) >= {"name", "age", "city"}
    assert re.fullmatch(r"\w+ \w+", record["name"])
    assert isinstance(record["age"], int) and 18 <= record["age"] <= 90
    assert '", "age": ' in first_line


@pytest.mark.parametrize("prompt", ["Call ", "Her phone number is ", "You can reach Maria at "])
def test_greedy_phone_number(demo, prompt: str) -> None:
    text = _greedy(demo, prompt, max_new_tokens=20)
    assert re.search(r"\d{3}[- ]\d{4}\b", text), text


def test_greedy_arithmetic_starts_with_a_number(demo) -> None:
    text = _greedy(demo, "7 + 5 = ", max_new_tokens=4)
    assert re.match(r"\d+", text), text


# --- corpus ------------------------------------------------------------------


def test_corpus_is_deterministic(tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "a.txt", 300, seed=1).read_text(encoding="utf-8")
    b = write_corpus(tmp_path / "b.txt", 300, seed=1).read_text(encoding="utf-8")
    c = write_corpus(tmp_path / "c.txt", 300, seed=2).read_text(encoding="utf-8")
    assert a == b
    assert a != c
    assert list(iter_documents(50, 7)) == list(iter_documents(50, 7))


def test_corpus_documents_end_with_eot_and_mix_kinds() -> None:
    docs = list(iter_documents(400, 0))
    assert all(doc.endswith(EOT) and doc.count(EOT) == 1 for doc in docs)
    text = "".join(docs)
    assert '{"name": ' in text
    assert re.search(r"\d{3}-\d{4}", text)
    assert re.search(r"^\d+ [-+*] \d+ = \d+$", text, re.MULTILINE)
    assert " lives in " in text or " works as a " in text


def test_corpus_json_lines_parse() -> None:
    records = [
        json.loads(line)
        for doc in iter_documents(400, 3)
        for line in doc.removesuffix(EOT).split("\n")
        if line.startswith("{")
    ]
    assert len(records) > 50
    assert all({"name", "age", "city"} <= set(r) for r in records)
    assert any("email" in r for r in records) and any("job" in r for r in records)
    assert len({tuple(r) for r in records}) > 1  # key order varies


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval_arithmetic(expr: str) -> int:
    """Evaluate integer ``+ - *`` arithmetic with parentheses, and nothing else."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"not simple arithmetic: {ast.dump(node)}")

    return ev(ast.parse(expr, mode="eval").body)


def test_corpus_arithmetic_is_correct() -> None:
    pattern = re.compile(r"^([\d+\-*() ]+) = (\d+)$")
    n = 0
    for doc in iter_documents(2000, 11):
        for line in doc.removesuffix(EOT).split("\n"):
            m = pattern.match(line)
            if m:
                assert _eval_arithmetic(m.group(1)) == int(m.group(2)), line
                n += 1
    assert n > 500


@pytest.mark.parametrize(
    ("n_docs", "seed", "error"),
    [(0, 0, ValueError), (-3, 0, ValueError), (2.5, 0, TypeError), (5, "x", TypeError)],
)
def test_corpus_rejects_bad_arguments(n_docs, seed, error) -> None:
    with pytest.raises(error):
        list(iter_documents(n_docs, seed))


# --- training ------------------------------------------------------------------


def test_pack_documents_starts_rows_at_documents() -> None:
    rows = pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12, 13, 14, 15, 16, 17], [18]], 4)
    assert rows.tolist() == [[1, 2, 3, 4], [4, 5, 6, 7], [6, 7, 8, 9], [10, 11, 12, 13], [11, 12, 13, 14]]


def test_train_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        train(tmp_path / "out", steps=0)
    with pytest.raises(ValueError, match="n_docs must be >= 1, got -1"):
        train_main(["--out", str(tmp_path / "out"), "--docs", "-1"])
    assert not (tmp_path / "out").exists()


def test_train_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("from an older run")
    threads = torch.get_num_threads()
    try:  # one thread: tiny ops on 2 threads crawl when other processes share the CPU
        result = train(out, seed=0, steps=2, n_docs=300, batch_size=4, num_threads=1)
    finally:
        torch.set_num_threads(threads)
    assert result.steps == 2 and result.final_loss > 0
    assert "final loss" in capsys.readouterr().out
    assert not (out / "stale.txt").exists()  # replaced as a whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary leftovers
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert len(tokenizer) == model.config.vocab_size
    assert tokenizer.eos_token_id == model.generation_config.pad_token_id == 0
