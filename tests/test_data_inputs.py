"""What goes into the pipeline: prepared datasets, the built-in corpus, tokenizers, and every bad input.

The tools are called through their ``main`` (the same code as on the command line, without a
subprocess); a bad input must give exit code 2 and one stderr line naming the problem.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from MaxText.config import ConfigError
from MaxText.data.builtin import builtin_name
from MaxText.data.source import make_data_source, open_records
from MaxText.data.tokenizer import ByteTokenizer, make_tokenizer
from MaxText.train.__main__ import main as train_main
from tests.conftest import make_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import prepare_dataset  # noqa: E402
import train_tokenizer  # noqa: E402

SAMPLE = "def f(x):\n    return x + 1  # naïve — ünïcödé, 日本語, emoji 🙂\n\n"


def exit_code(argv: list[str]) -> int:
    """The training entry point's exit code (config errors exit at once, data errors return)."""
    try:
        return train_main(argv)
    except SystemExit as done:
        return done.code


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A folder of mixed inputs prepared with tools/prepare_dataset.py as ``mixed``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path_factory.mktemp("inputs")
    (src / "sub").mkdir()
    for i in range(6):
        (src / "sub" / f"note{i}.md").write_text(f"note {i}\n" + SAMPLE * (i + 1))
    (src / "broken.txt").write_bytes(b"latin-1 caf\xe9 and \xff\xfe")  # 3 undecodable bytes
    (src / "empty.txt").write_text("")
    (src / ".hidden").write_text("never read")
    lines = [json.dumps({"text": f"json record {i}", "id": i}) for i in range(4)]
    (src / "records.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": [f"parquet row {i}" for i in range(3)], "n": [1, 2, 3]}), src / "rows.parquet")
    out = tmp_path_factory.mktemp("prepared")
    argv = ["--input", str(src), "--output", str(out), "--name", "mixed", "--val-fraction", "0.2", "--num-shards", "2"]
    assert prepare_dataset.main(argv) == 0
    return out


def test_prepared_dataset_has_every_document_once(prepared, capsys):
    config = make_config("dataset_type=tfds", "dataset_name=mixed", f"dataset_path={prepared}")
    texts = [r["text"].decode() for split in ("train", "validation") for r in open_records(config, split)]
    # 6 notes + 1 broken file + 4 json records + 3 parquet rows; empty and hidden files are skipped
    assert len(texts) == 14 and len(set(texts)) == 14
    assert round(14 * 0.2) == len(list(open_records(config, "validation")))
    assert "json record 2" in texts and "parquet row 1" in texts
    assert "latin-1 caf\ufffd and \ufffd\ufffd" in texts
    assert len(list((prepared / "mixed" / "1.0.0").glob("mixed-train.array_record-*-of-00002"))) == 2


def test_prepare_dataset_reports_replaced_bytes(tmp_path, capsys):
    (tmp_path / "a.txt").write_bytes(b"ok \xff\xff")
    assert (
        prepare_dataset.main(["--input", str(tmp_path / "*.txt"), "--output", str(tmp_path / "o"), "--name", "g"]) == 0
    )
    assert "replaced 2 undecodable bytes in 1 files" in capsys.readouterr().out


@pytest.mark.parametrize(
    "case, needle",
    [
        ("missing", "input not found"),
        ("empty_folder", "no input files"),
        ("empty_files", "no non-empty documents"),
        ("jsonl_without_field", "text field 'text' missing"),
        ("parquet_without_field", "text field 'text' missing"),
        ("bad_name", "lower_snake_case"),
    ],
)
def test_prepare_dataset_bad_input_exits_2(case, needle, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src, name = tmp_path / "in", "ok_name"
    src.mkdir()
    if case == "empty_files":
        (src / "a.txt").write_text("  \n")
    elif case == "jsonl_without_field":
        (src / "a.jsonl").write_text('{"body": "x"}\n')
    elif case == "parquet_without_field":
        pq.write_table(pa.table({"body": ["x"]}), src / "a.parquet")
    elif case == "bad_name":
        (src / "a.txt").write_text("x")
        name = "Bad-Name"
    path = tmp_path / "nowhere" if case == "missing" else src
    assert prepare_dataset.main(["--input", str(path), "--output", str(tmp_path / "o"), "--name", name]) == 2
    line = one_error_line(capsys)
    assert needle in line
    if case != "bad_name":
        assert str(path) in line or "a.jsonl" in line or "a.parquet" in line


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["dataset_path={missing}"], "dataset_path"),
        (["dataset_name=nothing_here"], "no prepared dataset 'nothing_here'"),
        (["dataset_text_field=body"], "'body' is not a feature"),
        (["eval_split=test"], "no split 'test'"),
        (["tokenizer_type=huggingface"], "tokenizer_path"),
        (["vocab_size=200"], "smaller than the tokenizer's vocabulary (259)"),
    ],
)
def test_training_on_bad_data_exits_2_naming_the_key(prepared, tmp_path, capsys, overrides, needle):
    args = [
        "dataset_type=tfds",
        "dataset_name=mixed",
        f"dataset_path={prepared}",
        f"base_output_directory={tmp_path}",
        "run_name=bad",
        "max_target_length=16",  # vocab_size=200 must fail on the tokenizer, not on the model
    ]
    args += [o.format(missing=tmp_path / "missing") for o in overrides]
    assert exit_code(args) == 2
    assert needle in one_error_line(capsys)


def test_empty_split_is_an_error(tmp_path, capsys):
    (tmp_path / "only.txt").write_text("a single document")
    assert prepare_dataset.main(["--input", str(tmp_path), "--output", str(tmp_path / "o"), "--name", "one"]) == 0
    config = make_config("dataset_type=tfds", "dataset_name=one", f"dataset_path={tmp_path / 'o'}")
    make_data_source(config, 2, 0, 1)  # the training split is fine
    with pytest.raises(ConfigError, match="eval_split.*no split 'validation'"):
        open_records(config, config.eval_split)


# ---------------------------------------------------------------- the built-in corpus


def test_builtin_corpus_is_python_source(tmp_path):
    config = make_config("dataset_type=builtin", "builtin_max_files=6", f"dataset_path={tmp_path}")
    batch = next(make_data_source(config, 2, 0, 1))
    assert (tmp_path / builtin_name(6) / "1.0.0" / "dataset_info.json").is_file()
    assert len(open_records(config, "train")) + len(open_records(config, "validation")) <= 6
    text = ByteTokenizer().decode(batch["inputs"][0])
    assert "import" in text or "def " in text or '"""' in text or "#" in text
    assert batch["inputs"].shape == (2, config.max_target_length)


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(SAMPLE)
    assert ids.min() >= 3 and ids.max() < tok.vocab_size
    assert tok.decode(ids) == SAMPLE
    assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id]])) == SAMPLE


def test_trained_bpe_tokenizer_round_trip(prepared, tmp_path, capsys):
    out = tmp_path / "tok"
    argv = ["dataset_type=tfds", "dataset_name=mixed", f"dataset_path={prepared}", "--output", str(out)]
    assert train_tokenizer.main([*argv, "--vocab-size", "300"]) == 0
    config = make_config("tokenizer_type=huggingface", f"tokenizer_path={out}")
    tok = make_tokenizer(config)
    assert tok.vocab_size <= 300 and tok.bos_id is not None and tok.eos_id is not None
    ids = tok.encode(SAMPLE * 2)
    assert len(ids) < len((SAMPLE * 2).encode())  # merges were learned
    assert tok.decode(ids) == SAMPLE * 2
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == SAMPLE * 2
    with pytest.raises(ConfigError, match="vocab_size"):
        make_tokenizer(make_config("tokenizer_type=huggingface", f"tokenizer_path={out}", "vocab_size=260"))


def test_sentencepiece_round_trip(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE * 20 + "the quick brown fox jumps over the lazy dog\n" * 20)
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=320,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    tok = make_tokenizer(make_config("tokenizer_type=sentencepiece", f"tokenizer_path={tmp_path / 'sp.model'}"))
    text = "the lazy fox returns x + 1 🙂\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.bos_id is not None and tok.eos_id is not None


def test_tokenizer_bad_paths():
    with pytest.raises(ConfigError, match="tokenizer_path.*no such file"):
        make_tokenizer(make_config("tokenizer_type=sentencepiece", "tokenizer_path=/no/such.model"))
    with pytest.raises(ConfigError, match="vocab_size"):
        make_tokenizer(make_config("vocab_size=100"))
