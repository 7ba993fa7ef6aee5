"""The grain pipeline on a real (tiny) TFDS ArrayRecord dataset: packing, process shards, resumable state.

One dataset is built per module: 24 documents, each starting with a unique marker, a few longer
than a sequence (so they are split into pieces) and most much shorter (so rows hold several).
"""

import json

import flax.linen as nn
import jax
import numpy as np
import pytest

from MaxText.data.pipeline import GrainSource, make_dataset, split_document
from MaxText.data.source import make_data_source, open_records
from MaxText.data.text_dataset import Corpus, build_text_dataset
from MaxText.data.tokenizer import ByteTokenizer
from MaxText.models.deepseek import DeepSeekV3
from tests.conftest import make_config

LENGTH = 64  # max_target_length in these tests
ROWS = 4
NUM_DOCS = 24


def marker(i: int) -> str:
    return f"doc-{i:03d}:"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[str, list[str]]:
    """(dataset_path, train texts) of a prepared dataset named ``tiny``."""
    root = tmp_path_factory.mktemp("data")
    texts = {}
    rng = np.random.default_rng(0)
    for i in range(NUM_DOCS):
        count = 40 if i % 6 == 0 else int(rng.integers(0, 3))  # a few split documents, many short ones
        words = " ".join(f"w{rng.integers(100)}" for _ in range(count))
        texts[f"f{i:03d}.txt"] = f"{marker(i)} {words}\n"
        (root / f"f{i:03d}.txt").write_text(texts[f"f{i:03d}.txt"])
    output = tmp_path_factory.mktemp("prepared")
    summary = build_text_dataset(Corpus(sorted(root.iterdir()), root=root), output, "tiny", 0.1)
    assert summary.validation_documents == 2 and summary.train_documents == NUM_DOCS - 2
    config = data_config(str(output))
    train_texts = [r["text"].decode() for r in open_records(config, "train")]
    assert len(train_texts) == NUM_DOCS - 2
    return str(output), train_texts


def data_config(path: str, *overrides: str):
    return make_config(
        "dataset_type=tfds",
        "dataset_name=tiny",
        f"dataset_path={path}",
        f"max_target_length={LENGTH}",
        "grain_worker_count=0",
        *overrides,
    )


def one_epoch(config, process_index=0, process_count=1, shuffle=True) -> list[dict]:
    records = open_records(config, config.train_split)
    dataset = make_dataset(
        config,
        records,
        ByteTokenizer(),
        ROWS,
        process_index,
        process_count,
        shuffle=shuffle,
        num_epochs=1,
        worker_count=0,
    )
    return list(dataset)


def segments(batches: list[dict]):
    """(inputs, targets, positions) of every packed segment, in order."""
    for batch in batches:
        for row in range(len(batch["inputs"])):
            seg = batch["inputs_segmentation"][row]
            assert (batch["targets_segmentation"][row] == seg).all()
            for sid in np.unique(seg[seg > 0]):
                where = np.flatnonzero(seg == sid)
                assert (np.diff(where) == 1).all(), "a segment must be contiguous"
                yield (batch["inputs"][row, where], batch["targets"][row, where], batch["inputs_position"][row, where])


def pieces_of(tokens: np.ndarray) -> list[tuple]:
    return [tuple(p["inputs"]) + (p["targets"][-1],) for p in split_document(tokens, LENGTH)]


def document_tokens(text: str) -> np.ndarray:
    tok = ByteTokenizer()
    return np.concatenate([[tok.bos_id], tok.encode(text), [tok.eos_id]]).astype(np.int32)


# ---------------------------------------------------------------- packing


def test_packing_loses_no_token_and_marks_documents(dataset):
    path, texts = dataset
    batches = one_epoch(data_config(path))
    got = []
    for inputs, targets, positions in segments(batches):
        np.testing.assert_array_equal(positions, np.arange(len(inputs)))  # per-document positions
        np.testing.assert_array_equal(inputs[1:], targets[:-1])  # targets are the next tokens
        got.append(tuple(inputs) + (targets[-1],))
    expected = [piece for text in texts for piece in pieces_of(document_tokens(text))]
    assert sorted(got) == sorted(expected)  # every piece once: no token lost or repeated
    assert any(len(pieces_of(document_tokens(t))) > 1 for t in texts), "some documents must be split"
    per_row = [len(np.unique(s[s > 0])) for b in batches for s in b["inputs_segmentation"]]
    assert max(per_row) >= 3, "short documents must share rows"
    for batch in batches:  # padding carries no loss and no tokens
        pad = batch["inputs_segmentation"] == 0
        assert (batch["targets_segmentation"][pad] == 0).all() and (batch["inputs"][pad] == 0).all()


def test_without_packing_one_piece_per_row(dataset):
    path, texts = dataset
    batches = one_epoch(data_config(path, "packing=false"))
    rows = [s for b in batches for s in b["inputs_segmentation"]]
    assert all(set(np.unique(r)) <= {0, 1} for r in rows)
    assert len(rows) == sum(len(pieces_of(document_tokens(t))) for t in texts)


def test_cross_document_attention_gives_one_segment_and_row_positions(dataset):
    path, _ = dataset
    batch = one_epoch(data_config(path, "packing_cross_document_attention=true"))[0]
    seg, pos = batch["inputs_segmentation"], batch["inputs_position"]
    assert set(np.unique(seg)) <= {0, 1}
    np.testing.assert_array_equal(pos, np.where(seg > 0, np.arange(LENGTH), 0))
    assert batch["targets_segmentation"].max() > 1  # the loss still knows the documents


def test_no_cross_document_attention_in_the_model(dataset):
    """A packed row gives each document the logits it gets alone at the start of a row."""
    path, _ = dataset
    config = data_config(path, "mtp_num_layers=0", "base_num_decoder_layers=2")  # a dense and a MoE layer
    rows = [{k: v[i : i + 1] for k, v in b.items()} for b in one_epoch(config) for i in range(len(b["inputs"]))]
    row = max(rows, key=lambda r: len(np.unique(r["inputs_segmentation"])))
    seg_ids = [s for s in np.unique(row["inputs_segmentation"][0]) if s > 0]
    assert len(seg_ids) >= 3
    alone_rows = []
    for sid in seg_ids:
        where = np.flatnonzero(row["inputs_segmentation"][0] == sid)
        r = {k: np.zeros((1, LENGTH), np.int32) for k in ("inputs", "inputs_position", "inputs_segmentation")}
        r["inputs"][0, : len(where)] = row["inputs"][0, where]
        r["inputs_position"][0, : len(where)] = np.arange(len(where))
        r["inputs_segmentation"][0, : len(where)] = 1
        alone_rows.append(r)
    tokens, positions, seg = (
        np.concatenate([row[k]] + [r[k] for r in alone_rows])
        for k in ("inputs", "inputs_position", "inputs_segmentation")
    )
    model = DeepSeekV3(config)
    # Random weights of the right shapes: any weights must keep documents apart (and a real init
    # costs more compile time than the whole test).
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens[:1], positions[:1], seg[:1]))
    rng = np.random.default_rng(0)
    variables = jax.tree.map(lambda a: (0.05 * rng.standard_normal(a.shape)).astype(a.dtype), shapes)
    (logits, _), _ = jax.jit(lambda t, p, s: model.apply(variables, t, p, s, mutable=True))(tokens, positions, seg)
    logits = np.asarray(logits)
    for i, sid in enumerate(seg_ids, 1):
        where = np.flatnonzero(row["inputs_segmentation"][0] == sid)
        np.testing.assert_allclose(logits[0, where], logits[i, : len(where)], atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------- shards


def first_markers(batches: list[dict]) -> list[str]:
    """The marker of every document whose first piece appears (it starts with BOS)."""
    tok = ByteTokenizer()
    return [tok.decode(inputs[1:9]) for inputs, _, _ in segments(batches) if inputs[0] == tok.bos_id]


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_shards_are_disjoint_and_cover_the_data(dataset, process_count):
    path, texts = dataset
    config = data_config(path)
    shards = [first_markers(one_epoch(config, i, process_count)) for i in range(process_count)]
    everything = sorted(m for shard in shards for m in shard)
    assert everything == sorted(t[:8] for t in texts)  # each document exactly once over all processes
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1, sizes


# ---------------------------------------------------------------- determinism and state


def take(source, n: int) -> list[dict]:
    return [next(source) for _ in range(n)]


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def test_same_seed_same_batches_other_seed_other_batches(dataset):
    path, _ = dataset
    a = take(make_data_source(data_config(path, "seed=0"), ROWS, 0, 1), 3)
    b = take(make_data_source(data_config(path, "seed=0"), ROWS, 0, 1), 3)
    c = take(make_data_source(data_config(path, "seed=1"), ROWS, 0, 1), 3)
    assert_same(a, b)
    assert any((x["inputs"] != y["inputs"]).any() for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("workers", [0, 1])
def test_restored_iterator_gives_the_same_next_batches(dataset, workers):
    """Mid-epoch (the first epoch holds about 6 batches), with and without worker processes."""
    path, _ = dataset
    config = data_config(path, f"grain_worker_count={workers}")
    source = make_data_source(config, ROWS, 0, 1)
    take(source, 4)
    state = json.loads(json.dumps(source.get_state()))  # what a checkpoint stores
    expected = take(source, 6)  # runs into the next epoch too
    source.close()
    restored = make_data_source(config, ROWS, 0, 1)
    restored.set_state(state)
    assert_same(take(restored, 6), expected)
    restored.close()
    assert isinstance(restored, GrainSource)


def test_eval_source_repeats_the_same_batches(dataset):
    from MaxText.data.source import make_eval_source

    path, _ = dataset
    source = make_eval_source(data_config(path, "eval_interval=5"), ROWS, 0, 1)
    start = source.get_state()
    first = take(source, 2)
    source.set_state(start)
    assert_same(take(source, 2), first)
    assert make_eval_source(data_config(path, "eval_interval=0"), ROWS, 0, 1) is None
