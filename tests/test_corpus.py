"""A tokenised corpus on disk: prepared, packed with its documents' boundaries kept, loaded
in the global order, and trained on with a block-diagonal causal mask."""

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import warm_script
import torch
import torch.nn.functional as F

from lightning_hetermoe import DataConfig, ModelConfig, MoELanguageModel, TokenizedDataModule
from lightning_hetermoe.configs import ConfigError, PrepareConfig
from lightning_hetermoe.corpus.format import META, read_meta
from lightning_hetermoe.model.corpus import TokenCorpus, split_documents
from lightning_hetermoe.model.lm import IGNORE_INDEX
from lightning_hetermoe.corpus.prepare import prepare_corpus
from lightning_hetermoe.model.sampling import GlobalOrderSampler, ResumableLoader
from lightning_hetermoe.model.transformer import document_layout

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the expert router sends every token to two of eight experts while attention runs on the newer "
         "device and gradients flow back through each micro batch café naïve λ-calculus 数据 ").split()


def make_documents(n: int = 14, seed: int = 0) -> list[str]:
    """Documents of varied length (one very short), with non-ASCII text and line breaks."""
    rng = random.Random(seed)
    docs = []
    for d in range(n):
        words = 3 if d == 3 else rng.randint(150, 500)
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(words // 8 + 1)]
        docs.append(f"Document {d}.\n" + "\n".join(lines) + ("\n" if d % 2 else ""))
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory of text files, one empty (left out), prepared with a 300-token BPE."""
    root = tmp_path_factory.mktemp("corpus")
    texts = root / "texts"
    texts.mkdir()
    docs = make_documents()
    for i, text in enumerate(docs):
        (texts / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    (texts / "doc99_empty.txt").write_text("")
    out = root / "prepared"
    lines = []
    meta = prepare_corpus(PrepareConfig(input=str(texts), out=str(out), vocab_size=300), log=lines.append)
    return out, docs, meta, lines


def tokenizer(out):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(out / "tokenizer.json"))


def data_cfg(out, **kw) -> DataConfig:
    return DataConfig(**{"corpus": "tokenized", "path": str(out), "seq_len": 32, "batch_size": 4,
                         "train_windows": None, "val_fraction": 0.15, "seed": 3, **kw})


def test_round_trip_and_index_match_the_documents(corpus):
    out, docs, meta, lines = corpus
    assert meta.num_documents == len(docs), "the empty file is left out"
    assert any("1 empty document(s) left out" in line for line in lines)
    on_disk = json.loads((out / META).read_text())
    assert on_disk["vocab_size"] == meta.vocab_size <= 300 and on_disk["dtype"] == "uint16"
    assert on_disk["tokenizer"]["kind"] == "bpe" and on_disk["tokenizer"]["eos_token"] == "<|endoftext|>"
    tok = tokenizer(out)
    assert tok.get_vocab_size() == meta.vocab_size and tok.token_to_id("<|endoftext|>") == meta.eos_id
    c = TokenCorpus(out)
    assert c.tokens.dtype == np.uint16 and len(c.tokens) == meta.num_tokens == int(c.index[-1])
    assert c.index[0] == 0 and np.all(np.diff(c.index) > 1)
    assert (out / "tokens.bin").stat().st_size == 2 * meta.num_tokens
    for i, text in enumerate(docs):
        ids = c.document(i)
        assert ids[-1] == meta.eos_id and meta.eos_id not in ids[:-1], f"document {i} ends with its end token only"
        assert ids[:-1].tolist() == tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids[:-1].tolist(), skip_special_tokens=False) == text, f"document {i} round trip"


def test_validation_holds_out_whole_documents(corpus):
    out, docs, meta, _ = corpus
    lengths = np.diff(TokenCorpus(out).index)
    train, val = split_documents(lengths, 0.15, seed=3)
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(len(docs))) and len(val) >= 1
    assert lengths[val].sum() >= 0.15 * lengths.sum() > lengths[val].sum() - lengths[val].max(), \
        "just enough whole documents to reach the fraction"
    assert not np.array_equal(val, split_documents(lengths, 0.15, seed=4)[1]), "the choice follows the seed"
    dm = TokenizedDataModule(data_cfg(out))
    dm.setup()
    assert dm.train_set.doc_ids.tolist() == train.tolist() and dm.val_set.doc_ids.tolist() == val.tolist()


def expected_stream(corpus: TokenCorpus, doc_ids) -> tuple[np.ndarray, np.ndarray]:
    """The documents back to back, and at each position whether a document starts there."""
    parts = [corpus.document(d) for d in doc_ids]
    starts = np.zeros(sum(len(p) for p in parts), dtype=bool)
    starts[np.cumsum([0] + [len(p) for p in parts[:-1]])] = True
    return np.concatenate(parts).astype(np.int64), starts


@pytest.mark.parametrize("split", ["train_set", "val_set"])
def test_packing_keeps_the_documents_boundaries(corpus, split):
    out, *_ = corpus
    dm = TokenizedDataModule(data_cfg(out, val_windows=1000))  # every validation row
    dm.setup()
    ds = getattr(dm, split)
    L = 32
    stream, starts = expected_stream(dm.corpus, ds.doc_ids)
    assert ds.num_rows == (len(stream) - 1) // L and len(ds) == ds.num_rows
    rows_with_boundary = 0
    for i in range(len(ds)):
        x, y, seg = ds[i]
        lo = i * L
        assert x.dtype == y.dtype == seg.dtype == torch.int64 and x.shape == y.shape == seg.shape == (L,)
        assert x.tolist() == stream[lo : lo + L].tolist()
        skipped = (y == IGNORE_INDEX).numpy()
        # the skipped targets are exactly those that are a document's first token
        assert skipped.tolist() == starts[lo + 1 : lo + L + 1].tolist()
        assert y[~torch.from_numpy(skipped)].tolist() == stream[lo + 1 : lo + L + 1][~skipped].tolist()
        # segment ids start at 0 and change exactly where a document starts
        changes = (seg[1:] != seg[:-1]).numpy()
        assert seg[0] == 0 and changes.tolist() == starts[lo + 1 : lo + L].tolist()
        assert torch.all(seg[1:] - seg[:-1] >= 0)
        rows_with_boundary += bool(skipped.any())
    assert rows_with_boundary == len(ds.doc_ids) - 1 >= 1, "each boundary after the first document: one skipped target"
    # without the document mask: plain (input, target) rows over the same stream, nothing skipped
    plain = TokenizedDataModule(data_cfg(out, val_windows=1000, document_mask=False))
    plain.setup()
    for i in range(len(ds)):
        x, y = getattr(plain, split)[i]
        assert x.tolist() == stream[i * L : i * L + L].tolist() and y.tolist() == stream[i * L + 1 : i * L + L + 1].tolist()


def global_batches(ds, world: int, epoch: int, seed: int, batch: int, start: int = 0) -> list[list[list[int]]]:
    """Each step's global batch (its rows' input tokens, in global order) with ``world`` ranks."""
    loaders = []
    for r in range(world):
        s = GlobalOrderSampler(ds, num_replicas=world, rank=r, shuffle=True, seed=seed)
        s.set_epoch(epoch)
        s.start = start
        loaders.append(ResumableLoader(ds, batch_size=batch // world, sampler=s, drop_last=True))
    out = []
    for parts in zip(*loaders, strict=True):
        rows = [p[0] for p in parts]  # each rank's inputs [b, L]; rank r holds global samples r, r+W, ...
        out.append(torch.stack(rows, 1).reshape(-1, rows[0].shape[-1]).tolist())
    return out


def test_the_global_order_is_seeded_per_epoch_and_resumes_mid_epoch(corpus):
    out, *_ = corpus
    dm = TokenizedDataModule(data_cfg(out))
    dm.setup()
    ds, G = dm.train_set, 8
    e0 = global_batches(ds, 1, 0, seed=3, batch=G)
    assert len(e0) == len(ds) // G >= 4
    assert e0 == global_batches(ds, 1, 0, seed=3, batch=G) == global_batches(ds, 2, 0, seed=3, batch=G)
    assert e0 != global_batches(ds, 1, 1, seed=3, batch=G), "each epoch its own order"
    assert e0 != global_batches(ds, 1, 0, seed=4, batch=G), "the order follows the seed"
    # the datamodule's own loader (batch 4, one process) follows the same order; its state
    # after 3 batches resumes at the 4th global batch of the epoch: in a fresh loader, and
    # on two ranks of 2 rows each
    consumed = {"n": 3}
    dm._consumed_train_batches = lambda: consumed["n"]
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(1)
    e1 = global_batches(ds, 1, 1, seed=3, batch=4)
    assert [b[0].tolist() for b in loader] == e1
    state = loader.state_dict()
    assert state == {"epoch": 1, "position": 3 * 4}
    fresh = TokenizedDataModule(data_cfg(out))
    fresh.setup()
    resumed = fresh.train_dataloader()
    resumed.load_state_dict(state)
    batches = list(resumed)
    assert [b[0].tolist() for b in batches] == e1[3:]
    assert all(len(b) == 3 for b in batches), "(input, target, segments) every batch"
    assert global_batches(ds, 2, 1, seed=3, batch=4, start=state["position"]) == e1[3:]


def _doc(n, seed):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n_kv_heads,checkpointing", [(None, False), (2, True)])
def test_a_packed_row_gives_each_document_the_logits_it_gets_alone(n_kv_heads, checkpointing):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, d_model=32, n_heads=4, n_kv_heads=n_kv_heads, max_seq_len=64,
                      activation_checkpointing=checkpointing)
    model = MoELanguageModel(cfg).eval()
    a, b = _doc(21, 1), _doc(14, 2)
    rows = torch.stack([torch.cat([a, b]), torch.cat([b, a])])  # two layouts in one batch
    seg = torch.tensor([[0] * 21 + [1] * 14, [0] * 14 + [1] * 21])
    with torch.set_grad_enabled(checkpointing):  # checkpointing acts (and recomputes) only with grad
        packed = model(rows, seg)
    if checkpointing:
        packed.sum().backward()  # each block recomputed with the mask and positions
        assert model.model.embed.weight.grad is not None
    packed = packed.detach()
    with torch.no_grad():
        alone_a, alone_b = model(a[None])[0], model(b[None])[0]
        unmasked = model(rows)
    torch.testing.assert_close(packed[0, :21], alone_a, rtol=0, atol=2e-5)
    torch.testing.assert_close(packed[0, 21:], alone_b, rtol=0, atol=2e-5)
    torch.testing.assert_close(packed[1, :14], alone_b, rtol=0, atol=2e-5)
    torch.testing.assert_close(packed[1, 14:], alone_a, rtol=0, atol=2e-5)
    assert (unmasked[0, 21:] - alone_b).abs().max() > 0.1, "without segment ids the second document sees the first"
    # a row that is one document: the masked path equals the plain causal one
    with torch.no_grad():
        torch.testing.assert_close(model(rows, torch.zeros_like(rows)), unmasked, rtol=0, atol=2e-5)


def test_the_loss_is_the_mean_over_the_unskipped_targets():
    torch.manual_seed(0)
    model = MoELanguageModel(ModelConfig(vocab_size=300, d_model=32, n_heads=4, max_seq_len=64)).eval()
    a, b = _doc(21, 1), _doc(14, 2)
    row = torch.cat([a, b])
    x, y = row[:-1].clone(), row[1:].clone()
    y[20] = IGNORE_INDEX  # the target after a's end is b's first token
    seg = torch.tensor([0] * 21 + [1] * 13)
    with torch.no_grad():
        ce = model.losses((x[None], y[None], seg[None]))["ce"]
        la, lb = model(a[None, :-1])[0], model(b[None, :-1])[0]
    per_target = torch.cat([F.cross_entropy(la, a[1:], reduction="none"), F.cross_entropy(lb, b[1:], reduction="none")])
    assert per_target.numel() == 20 + 13
    torch.testing.assert_close(ce, per_target.mean(), rtol=1e-5, atol=1e-5)
    # the two-tensor batch of the byte data still trains the whole row as one sequence
    with torch.no_grad():
        whole = model.losses((x[None], row[None, 1:]))["ce"]
        expect = F.cross_entropy(model(x[None])[0], row[1:])
    torch.testing.assert_close(whole, expect, rtol=1e-5, atol=1e-6)


def test_document_layout_is_the_block_diagonal_causal_mask_and_restarts_positions():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 7, 7, 7, 7]])
    mask, pos = document_layout(seg)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]
    expect = torch.zeros(2, 6, 6, dtype=torch.bool)
    for r in range(2):
        for i in range(6):
            for j in range(i + 1):
                expect[r, i, j] = bool(seg[r, i] == seg[r, j])
    assert mask.shape == (2, 1, 6, 6) and torch.equal(mask[:, 0], expect)


def test_bad_input_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"input='.*nowhere' is invalid: no such file or directory"):
        prepare_corpus(PrepareConfig(input=str(tmp_path / "nowhere"), out=str(tmp_path / "o")), log=lambda s: None)
    with pytest.raises(ConfigError, match=r"input='.*\*\.md' is invalid: the glob matches no file"):
        prepare_corpus(PrepareConfig(input=str(tmp_path / "*.md"), out=str(tmp_path / "o")), log=lambda s: None)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    (empty / "b.jsonl").write_text('{"text": ""}\n\n')
    with pytest.raises(ConfigError, match=r"input='.*empty' is invalid: the corpus is empty"):
        prepare_corpus(PrepareConfig(input=str(empty), out=str(tmp_path / "o")), log=lambda s: None)
    (empty / "b.jsonl").write_text('{"body": "words"}\n')
    with pytest.raises(ConfigError, match=r"text_field='text' is invalid: .*b.jsonl:1 has no string field 'text'"):
        prepare_corpus(PrepareConfig(input=str(empty), out=str(tmp_path / "o")), log=lambda s: None)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"out='.*a_file/corpus' is invalid: the directory cannot be made"):
        prepare_corpus(PrepareConfig(input=str(empty), out=str(blocker / "corpus")), log=lambda s: None)
    with pytest.raises(ConfigError, match=r"vocab_size=100 is invalid: a byte-level BPE needs at least 257"):
        PrepareConfig(vocab_size=100)
    with pytest.raises(ConfigError, match=r"tokenizer='.*none' is invalid: no such file or directory"):
        prepare_corpus(PrepareConfig(input=str(empty), tokenizer=str(tmp_path / "none"), out=str(tmp_path / "o")),
                       log=lambda s: None)
    with pytest.raises(ConfigError, match=r"data.path='.*nowhere' is invalid: no such directory"):
        read_meta(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"data.path=None is invalid: data.corpus=tokenized needs"):
        DataConfig(corpus="tokenized")


def test_jsonl_documents_and_a_tokenizer_on_disk(corpus, tmp_path):
    """One document per JSON line, tokenised with the tokenizer another corpus saved (as a
    Hugging Face directory: its tokenizer.json and tokenizer_config.json's eos_token)."""
    out, *_ = corpus
    hf = tmp_path / "hf_tok"
    hf.mkdir()
    (hf / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    docs = ["first line\nof the first document", "the second: café", "third"]
    (tmp_path / "part.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    meta = prepare_corpus(PrepareConfig(input=str(tmp_path / "*.jsonl"), tokenizer=str(hf), out=str(tmp_path / "o")),
                          log=lambda s: None)
    assert meta.num_documents == 3 and meta.tokenizer["kind"] == "huggingface"
    c, tok = TokenCorpus(tmp_path / "o"), tokenizer(out)
    assert [tok.decode(c.document(i)[:-1].tolist()) for i in range(3)] == docs


def test_a_run_that_fails_leaves_the_corpus_in_out_as_it_was_and_no_directory_it_made(corpus, tmp_path):
    """The files are written beside ``out`` and moved in at the end: a failure in the middle
    (here a JSON line without its text, found while the documents are written) leaves the
    corpus already in ``out`` byte for byte, no partial directory, and no parent it made; a
    run that finishes replaces the corpus, in a directory of the usual mode."""
    out, *_ = corpus
    tok = tmp_path / "tokenizer.json"
    tok.write_bytes((out / "tokenizer.json").read_bytes())
    lines = [json.dumps({"text": "a document"}), json.dumps({"body": "no text field"})]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    kept = tmp_path / "kept"
    kept.mkdir()
    for f in out.iterdir():
        (kept / f.name).write_bytes(f.read_bytes())
    before = {f.name: f.read_bytes() for f in kept.iterdir()}

    def prepare(input_name: str, where: Path):
        return prepare_corpus(PrepareConfig(input=str(tmp_path / input_name), tokenizer=str(tok),
                                            eos_token="<|endoftext|>", out=str(where)), log=lambda s: None)

    with pytest.raises(ConfigError, match=r"bad.jsonl:2 has no string field 'text'"):
        prepare("bad.jsonl", kept)
    assert {f.name: f.read_bytes() for f in kept.iterdir()} == before
    fresh = tmp_path / "made" / "deeper" / "corpus"
    with pytest.raises(ConfigError, match=r"bad.jsonl:2 has no string field 'text'"):
        prepare("bad.jsonl", fresh)
    assert not (tmp_path / "made").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "kept", "tokenizer.json"]

    (tmp_path / "good.jsonl").write_text(lines[0] + "\n")
    assert prepare("good.jsonl", kept).num_documents == 1
    assert read_meta(kept).num_documents == 1 and TokenCorpus(kept).document(0).size > 1
    assert prepare("good.jsonl", fresh).num_documents == 1
    umask = os.umask(0)
    os.umask(umask)
    assert fresh.stat().st_mode & 0o777 == 0o777 & ~umask
    assert sorted(p.name for p in fresh.parent.iterdir()) == ["corpus"]


def test_the_model_takes_the_corpus_vocabulary(corpus):
    from lightning_hetermoe.run_config import fit_data_and_model

    out, _, meta, _ = corpus
    data, model = fit_data_and_model(data_cfg(out), ModelConfig())
    assert model.vocab_size == meta.vocab_size and Path(data.path).is_absolute()
    _, bigger = fit_data_and_model(data_cfg(out), ModelConfig(vocab_size=512))
    assert bigger.vocab_size == 512, "a padded vocabulary is kept"
    with pytest.raises(ConfigError, match="data.document_mask=true is invalid with model.architecture='hf_mixtral'"):
        fit_data_and_model(data_cfg(out), ModelConfig(architecture="hf_mixtral"))


def test_the_yaml_names_exactly_the_config_fields():
    """conf/data/*.yaml and conf/prepare_data.yaml map one-to-one onto their dataclasses, and
    each data entry builds."""
    from dataclasses import fields

    from omegaconf import OmegaConf

    for path in sorted((ROOT / "conf" / "data").glob("*.yaml")):
        cfg = OmegaConf.to_container(OmegaConf.load(path))
        assert set(cfg) == {f.name for f in fields(DataConfig)}, (path.name, set(cfg) ^ {f.name for f in fields(DataConfig)})
        DataConfig(**cfg)
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "prepare_data.yaml"))
    keys = set(cfg) - {"defaults", "hydra"}
    assert keys == {f.name for f in fields(PrepareConfig)}, keys ^ {f.name for f in fields(PrepareConfig)}
    PrepareConfig(**{k: cfg[k] for k in keys})


@pytest.mark.slow
def test_prepare_then_train_two_ranks_under_zebra(tmp_path):
    """The two commands a user runs, as subprocesses: prepare (a 300-token BPE on a few
    text files), then train on it, packed, on 2 CPU ranks under zebra."""
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, text in enumerate(make_documents(n=24, seed=1)):
        (texts / f"d{i}.txt").write_text(text)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    prep = subprocess.run([sys.executable, str(ROOT / "recipes" / "prepare_data.py"), f"input={texts}",
                           f"out={tmp_path / 'corpus'}", "vocab_size=300"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert prep.returncode == 0, prep.stderr[-3000:]
    assert "[prepare] wrote" in prep.stdout and (tmp_path / "corpus" / "tokens.bin").is_file()
    corpus_files = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "corpus").rglob("*") if p.is_file()}
    assert (tmp_path / "corpus" / ".hydra" / "overrides.yaml").is_file()
    # the same command again on input that fails half-way (a JSON line without its text):
    # one line, and the corpus and the config that made it as they were; a new out left unmade
    (tmp_path / "bad.jsonl").write_text('{"text": "a document"}\n{"body": "no text"}\n')
    for out in (tmp_path / "corpus", tmp_path / "unmade"):
        bad = subprocess.run([sys.executable, str(ROOT / "recipes" / "prepare_data.py"), f"input={tmp_path / 'bad.jsonl'}",
                              f"out={out}", "vocab_size=300"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
        assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith(
            "[prepare] config error: text_field='text' is invalid:"), bad.stderr[-3000:]
    assert {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "corpus").rglob("*")
            if p.is_file()} == corpus_files
    assert not (tmp_path / "unmade").exists()
    run = tmp_path / "run"
    proc = warm_script.run([sys.executable, str(ROOT / "recipes" / "train.py"), "data=tokenized",
                            f"data.path={tmp_path / 'corpus'}", "data.seq_len=32", "data.batch_size=4",
                            "cluster=cpu2", "strategy.mode=zebra", "trainer.max_steps=16",
                            "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", f"hydra.run.dir={run}"],
                           cwd=ROOT, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    vocab = json.loads((tmp_path / "corpus" / "meta.json").read_text())["vocab_size"]
    assert f"model.vocab_size=256 -> {vocab}" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategy"] == "hetermoe:zebra" and summary["world_size"] == 2 and summary["steps"] == 16
    assert summary["corpus"] == str(tmp_path / "corpus")
    metrics = next(run.glob("logs/version_*/metrics.csv"))
    losses = [float(r["train_loss"]) for r in csv.DictReader(open(metrics)) if r.get("train_loss")]
    assert all(np.isfinite(losses)) and len(losses) >= 10
    assert np.isfinite(summary["val_loss"])
    assert summary["final_loss"] < summary["first_loss"] - 0.5, summary
    assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses
