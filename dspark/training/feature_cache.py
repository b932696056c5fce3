"""An on-disk cache of the frozen target's outputs, so training epochs skip the target forward (docs/training.md).

Training a drafter online runs the 30-layer target over every batch; on a CPU that is most of a step once the loss
works on the draft vocabulary. The target is frozen, so its outputs for a data set never change: compute them once
with :func:`build_feature_cache` and train any number of epochs (and any anchors) from :class:`FeatureCache` through
:class:`CachedFeatureCollator`. What is stored per token of every sequence:

* ``features``   ``[T, m·H]`` bf16 — the raw decoder-layer outputs ``[H^(l_1); …; H^(l_m)]`` of eq. 2, exactly
  what :func:`dspark.generation.features.context_features` gives at inference;
* ``last_hidden`` ``[T, H]`` bf16 — the final normed hidden state; the target's logits at a block slot are
  ``LM_head(last_hidden)``, so the drafter's N draft columns cost an N×H product, not V×H;
* ``lse``        ``[T]`` float32 — logsumexp of the target's full-vocabulary logits (response positions only;
  NaN on prompt positions, which are never block slots), for the exact L1 term of eq. 12 with a draft vocabulary.

Layout: flat ``numpy.memmap`` files (bf16 stored as its raw 16 bits) plus ``index.npy`` (``idx, offset, length,
crc32`` per row) and ``meta.json`` (target, layers, sizes, ``complete``). The build is resumable: rows are written in
order and ``meta.json`` records how many are done after every batch. A cache is tied to one data set and one target:
opening it checks the layer ids and sizes, and every collated row is checked against its stored CRC of token ids.

Size: (m + 1)·H·2 + 4 bytes per token — 6.9 KB for SmolLM2-135M with m = 5, about 7.6 GB for 1.1M tokens.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from modeling_dspark.common import gather_slots, softcap
from modeling_dspark.configuration_dspark import logit_transform
from dspark.generation.features import context_features, hidden_state_indices
from modeling_dspark.target import decoder_of
from .trainer import DSparkCollator

__all__ = ["build_feature_cache", "FeatureCache", "CachedFeatureCollator", "FeatureCacheError"]

FORMAT_VERSION = 1


class FeatureCacheError(ValueError):
    """A feature cache that does not match the data, the drafter or the target, or that is incomplete/corrupt."""


def _crc(ids) -> int:
    return zlib.crc32(np.asarray(ids, dtype=np.int64).tobytes())


def target_fingerprint(target) -> str:
    """A cheap identity of a target's weights and dtype: CRC-32 over every parameter's name, shape, dtype and first
    4 KiB. Two checkpoints of one architecture (base vs. instruct, a fine-tune) or two dtypes differ."""
    crc = 0
    for name, p in target.named_parameters():
        head = p.detach().reshape(-1)[:2048].cpu().contiguous()
        raw = head.view(torch.int16) if head.element_size() == 2 else head.view(torch.int32)
        crc = zlib.crc32(f"{name}{tuple(p.shape)}{p.dtype}".encode(), crc)
        crc = zlib.crc32(raw.numpy().tobytes(), crc)
    return f"{crc:08x}"


def _bf16_to_u16(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def _write_meta(path: Path, meta: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, path)


@torch.no_grad()
def build_feature_cache(
    dataset,
    target,
    target_layer_ids,
    out_dir: str | os.PathLike,
    batch_size: int = 8,
    max_length: int | None = None,
    progress: bool = True,
) -> Path:
    """Run the frozen target once over ``dataset`` and store its features (resumable).

    Args:
        dataset: rows with ``input_ids`` (prompt + response), ``prompt_len`` and ``idx`` (e.g. from
            :func:`dspark.training.trainer.prepare_dataset`), in training order.
        target: the frozen target causal LM (any device / dtype; bf16 on CPU is ~2× faster than fp32).
        target_layer_ids: the drafter's ``config.target_layer_ids`` (m layers).
        out_dir: cache directory; an unfinished build there with the same settings is resumed, and a cache of a
            data set that has since grown by rows appended at the end (more shards) is extended.
        batch_size: consecutive rows per target forward.
        max_length: truncate sequences as the collator will (``None`` = keep all tokens).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        FeatureCacheError: ``out_dir`` holds a cache built with other settings or for other data.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layer_ids = [int(i) for i in target_layer_ids]
    rows, offsets, index = _row_index(dataset, max_length)
    meta = _cache_meta(target, layer_ids, index, int(offsets[-1]), max_length)
    _resume_meta(out, meta, index)
    if meta["complete"]:
        return out
    arrays = _open_arrays(out, meta)
    _fill_cache(out, meta, arrays, dataset, target, layer_ids, rows, offsets, batch_size, max_length, progress)
    meta["complete"] = True
    _write_meta(out / "meta.json", meta)
    return out


def _row_index(dataset, max_length: int | None) -> tuple[list[tuple[int, int, int, int]], np.ndarray, np.ndarray]:
    """Where each row of ``dataset`` goes in the flat per-token files.

    Returns ``(rows, offsets, index)``: ``rows`` one ``(idx, length, prompt_len, crc32 of token ids)`` per row (token
    ids cut at ``max_length``); ``offsets`` int64 ``[R + 1]``, the first token of each row (the last entry is the
    total token count); ``index`` int64 ``[R, 4]`` of ``idx, offset, length, crc32`` (``index.npy``).
    """
    rows = []
    for r in dataset:
        ids = list(r["input_ids"])[: max_length or None]
        rows.append((int(r["idx"]), len(ids), int(r["prompt_len"]), _crc(ids)))
    offsets = np.concatenate([[0], np.cumsum([n for _, n, _, _ in rows])]).astype(np.int64)
    index = np.array([(i, int(o), n, c) for (i, n, _, c), o in zip(rows, offsets[:-1])], dtype=np.int64).reshape(-1, 4)
    return rows, offsets, index


def _cache_meta(target, layer_ids: list[int], index: np.ndarray, total: int, max_length: int | None) -> dict:
    """A new cache's ``meta.json``: the target's identity and sizes, the target layers, the data (row count,
    ``total`` tokens, CRC of ``index``) and progress (no row done)."""
    return {
        "format_version": FORMAT_VERSION,
        "target": str(getattr(target.config, "_name_or_path", "")),
        "target_model_type": target.config.model_type,
        "target_fingerprint": target_fingerprint(target),
        "target_dtype": str(next(target.parameters()).dtype),
        "target_layer_ids": layer_ids,
        "hidden_size": int(target.config.hidden_size),
        "vocab_size": int(target.config.vocab_size),
        "num_rows": len(index),
        "num_tokens": total,
        "data_crc": zlib.crc32(index.tobytes()),
        "max_length": max_length,
        "rows_done": 0,
        "complete": False,
    }


def _resume_meta(out: Path, meta: dict, index: np.ndarray) -> None:
    """Match ``meta`` against the cache already in ``out``, if any, and take over its progress (``rows_done``,
    ``complete``); a data set grown by rows appended at the end is extended, not refused. Writes ``index.npy`` and
    ``meta.json`` for a new or grown cache.

    Raises:
        FeatureCacheError: the cache in ``out`` was built with other settings (target, dtype, layers, sizes,
            ``max_length``) or for other data.
    """
    meta_path = out / "meta.json"
    grow_from = None
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        old_index = np.load(out / "index.npy")
        fixed = ("format_version", "target_model_type", "target_fingerprint", "target_dtype", "target_layer_ids",
                 "hidden_size", "vocab_size", "max_length")
        diff = [k for k in fixed if k in old and old[k] != meta[k]]
        grown = len(index) > len(old_index) and np.array_equal(index[: len(old_index)], old_index)
        same_data = (old.get("num_rows"), old.get("data_crc")) == (meta["num_rows"], meta["data_crc"])
        if not diff and not grown and not same_data:
            diff = ["data"]
        if diff:
            raise FeatureCacheError(f"{out} holds a feature cache built with other settings or data ({', '.join(diff)}"
                                    " differ): remove it or choose another --feature-cache directory")
        meta["rows_done"] = int(old.get("rows_done", 0))
        meta["complete"] = bool(old.get("complete", False)) and not grown
        if grown:  # the data set grew (more shards of a resumed `dspark data build`): extend, keep the done rows
            grow_from = int(old["num_tokens"])
    if grow_from is not None or not meta_path.exists():
        np.save(out / "index.npy", index)
        _write_meta(meta_path, meta)


def _open_arrays(out: Path, meta: dict) -> tuple[np.memmap, np.memmap, np.memmap]:
    """The cache's per-token files as writable memmaps sized for ``meta``'s data: ``features [T, m·H]`` and
    ``last_hidden [T, H]`` uint16 (bf16 bits), ``lse [T]`` float32 (T = at least 1 row).

    Existing files are resized (a grown data set extends them); if any is missing all are created anew and the
    progress in ``meta`` is reset to no row done."""
    total, hidden, m = meta["num_tokens"], meta["hidden_size"], len(meta["target_layer_ids"])
    names = ("features.u16", "last_hidden.u16", "lse.f32")
    mode = "r+" if all((out / n).exists() for n in names) else "w+"
    if mode == "w+" and meta["rows_done"]:  # files lost: the done rows are gone too, start over
        meta["rows_done"], meta["complete"] = 0, False
        _write_meta(out / "meta.json", meta)
    if mode == "r+":  # size the files for this data (a grown data set extends them)
        for name, width in (("features.u16", m * hidden * 2), ("last_hidden.u16", hidden * 2), ("lse.f32", 4)):
            with open(out / name, "r+b") as fh:
                fh.truncate(max(total, 1) * width)
    feats = np.memmap(out / "features.u16", dtype=np.uint16, mode=mode, shape=(max(total, 1), m * hidden))
    last = np.memmap(out / "last_hidden.u16", dtype=np.uint16, mode=mode, shape=(max(total, 1), hidden))
    lse = np.memmap(out / "lse.f32", dtype=np.float32, mode=mode, shape=(max(total, 1),))
    return feats, last, lse


def _fill_cache(out: Path, meta: dict, arrays, dataset, target, layer_ids: list[int], rows, offsets: np.ndarray,
                batch_size: int, max_length: int | None, progress: bool) -> None:
    """Run the target over the rows not done yet (from ``meta["rows_done"]``), ``batch_size`` consecutive rows per
    forward, store their features in ``arrays`` (:func:`_open_arrays`) and record the progress in ``meta.json``
    after every batch. The target's train/eval mode is restored afterwards."""
    from tqdm.auto import tqdm

    feats, last, lse = arrays
    decoder = decoder_of(target)
    head = target.get_output_embeddings()
    scale, cap = logit_transform(target.config)  # Granite's and Cohere's scale, Gemma's soft-capping
    device = next(target.parameters()).device
    was_training = target.training
    target.eval()
    start = meta["rows_done"]
    bar = tqdm(total=len(rows), initial=start, desc="target features", unit="seq", disable=not progress)
    try:
        for s in range(start, len(rows), batch_size):
            chunk = list(range(s, min(s + batch_size, len(rows))))
            f, h = _target_features(decoder, dataset, chunk, max(rows[j][1] for j in chunk), layer_ids, max_length,
                                    device)
            for b, j in enumerate(chunk):
                _, n, plen, _ = rows[j]
                o = int(offsets[j])
                feats[o : o + n] = _bf16_to_u16(f[b, :n])
                last[o : o + n] = _bf16_to_u16(h[b, :n])
                lse[o : o + n] = _response_lse(head, h[b], plen, n, scale=scale, cap=cap)
            feats.flush()
            last.flush()
            lse.flush()
            meta["rows_done"] = chunk[-1] + 1
            _write_meta(out / "meta.json", meta)
            bar.update(len(chunk))
    finally:
        bar.close()
        target.train(was_training)


def _target_features(decoder, dataset, chunk: list[int], width: int, layer_ids: list[int], max_length: int | None,
                     device) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over the rows ``chunk`` of ``dataset`` (right-padded to ``width`` tokens, cut at
    ``max_length``): the context features ``[B, width, m·H]`` of eq. 2 and the final normed hidden states
    ``[B, width, H]``, in the target's dtype on ``device``."""
    ids = torch.zeros((len(chunk), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, j in enumerate(chunk):
        seq = list(dataset[j]["input_ids"])[: max_length or None]
        ids[b, : len(seq)] = torch.tensor(seq)
        attn[b, : len(seq)] = 1
    res = decoder(input_ids=ids.to(device), attention_mask=attn.to(device),
                  output_hidden_states=hidden_state_indices(layer_ids), use_cache=False)
    return context_features(res.hidden_states, layer_ids), res.last_hidden_state


def _response_lse(head, hidden: torch.Tensor, prompt_len: int, n: int, scale: float = 1.0,
                  cap: float | None = None) -> np.ndarray:
    """float32 ``[n]``: logsumexp of the target's full-vocabulary logits ``softcap(head(hidden), cap, scale)`` at the
    response positions of one row (from ``prompt_len − 1``), NaN on the prompt positions. ``hidden`` is the row's
    ``[L, H]`` final hidden states, rounded to bf16 first as the cache stores them."""
    values = np.full(n, np.nan, dtype=np.float32)
    lo = min(max(prompt_len - 1, 0), n)
    if lo < n:  # slots are response positions (anchor ≥ prompt_len); one earlier for safety
        # from the bf16-rounded state that is stored (training computes the draft columns from it)
        logits = softcap(head(hidden[lo:n].to(torch.bfloat16).to(head.weight.dtype)), cap, scale)
        values[lo:] = torch.logsumexp(logits.float(), dim=-1).cpu().numpy()
    return values


class FeatureCache:
    """Read access to a cache written by :func:`build_feature_cache`.

    Args:
        path: the cache directory.
        target_layer_ids: the drafter's ``config.target_layer_ids``; must equal the cache's.
        hidden_size: the target's hidden size H; must equal the cache's.
        target: the target model; when given, its weights and dtype must be the ones the cache was built from
            (:func:`target_fingerprint`).

    Raises:
        FeatureCacheError: missing / incomplete cache, other layer ids or hidden size, files of the wrong size.
    """

    def __init__(self, path: str | os.PathLike, target_layer_ids=None, hidden_size: int | None = None, target=None):
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not meta_path.exists():
            raise FeatureCacheError(f"{self.path} is not a feature cache (no meta.json): build it with "
                                    "`dspark train --feature-cache DIR` or build_feature_cache()")
        self.meta = meta = json.loads(meta_path.read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise FeatureCacheError(f"{self.path}: format_version {meta.get('format_version')} != {FORMAT_VERSION}")
        if not meta.get("complete"):
            raise FeatureCacheError(f"{self.path}: incomplete feature cache ({meta.get('rows_done')} of "
                                    f"{meta.get('num_rows')} rows): rerun the build to resume it")
        if target_layer_ids is not None and [int(i) for i in target_layer_ids] != meta["target_layer_ids"]:
            raise FeatureCacheError(f"{self.path} holds target layers {meta['target_layer_ids']}, the drafter reads "
                                    f"{list(target_layer_ids)}: rebuild the cache for these target_layer_ids")
        if hidden_size is not None and int(hidden_size) != meta["hidden_size"]:
            raise FeatureCacheError(f"{self.path} was built for hidden size {meta['hidden_size']}, the target has "
                                    f"{hidden_size}: a cache of another target")
        if target is not None and "target_fingerprint" in meta:
            mine = (target_fingerprint(target), str(next(target.parameters()).dtype))
            if mine != (meta["target_fingerprint"], meta.get("target_dtype")):
                raise FeatureCacheError(f"{self.path} was built from another target or dtype ({meta.get('target')}, "
                                        f"{meta.get('target_dtype')}): rebuild the cache for this target")
        total, hidden, m = meta["num_tokens"], meta["hidden_size"], len(meta["target_layer_ids"])
        expect = {"features.u16": total * m * hidden * 2, "last_hidden.u16": total * hidden * 2, "lse.f32": total * 4}
        for name, size in expect.items():
            f = self.path / name
            if not f.exists() or f.stat().st_size < size:
                raise FeatureCacheError(f"{f}: missing or truncated ({f.stat().st_size if f.exists() else 0} of "
                                        f"{size} bytes): rebuild the cache")
        rows = max(total, 1)
        self.features = np.memmap(self.path / "features.u16", dtype=np.uint16, mode="r", shape=(rows, m * hidden))
        self.last_hidden = np.memmap(self.path / "last_hidden.u16", dtype=np.uint16, mode="r", shape=(rows, hidden))
        self.lse = np.memmap(self.path / "lse.f32", dtype=np.float32, mode="r", shape=(rows,))
        index = np.load(self.path / "index.npy")
        self.rows = {int(i): (int(o), int(n), int(c)) for i, o, n, c in index}

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, idx: int, ids, length: int):
        """The first ``length`` positions of row ``idx``: ``(features [length, m·H] bf16, last_hidden [length, H]
        bf16, lse [length] float32)``.

        Raises:
            FeatureCacheError: ``idx`` is not in the cache, or ``ids`` (the row's full token ids, before any
            truncation to ``length``) differ from the ones the cache was built from.
        """
        if idx not in self.rows:
            raise FeatureCacheError(f"row idx={idx} is not in the feature cache {self.path}: data and cache differ")
        o, n, crc = self.rows[idx]
        ids = list(ids)[:n]
        if len(ids) != n or _crc(ids) != crc:
            raise FeatureCacheError(f"row idx={idx}: its tokens differ from the ones the feature cache {self.path} "
                                    "was built from: rebuild the cache for this data")
        if int(length) > n:
            raise FeatureCacheError(f"row idx={idx}: {length} tokens requested, the cache holds {n} (built with "
                                    f"max_length={self.meta.get('max_length')}): use the same --max-length")
        length = int(length)

        def bf16(a):
            return torch.from_numpy(np.array(a[o : o + length])).view(torch.bfloat16)

        return bf16(self.features), bf16(self.last_hidden), torch.from_numpy(np.array(self.lse[o : o + length]))


@dataclass
class CachedFeatureCollator(DSparkCollator):
    """:class:`~dspark.training.trainer.DSparkCollator` that also returns the target's cached outputs.

    Extra batch keys: ``context_features [B, L, m·H]`` bf16 (zeros on padding), ``slot_hidden [B, n, γ, H]`` bf16
    and ``slot_lse [B, n, γ]`` float32 at the block slots p..p+γ−1 (clamped to the row's end, as the loss masks
    those slots; +inf where no lse is stored, i.e. slots of invalid anchors, so their target probabilities are 0).
    :class:`~dspark.training.trainer.DSparkTrainer` then skips the target forward.
    """

    cache: FeatureCache | None = None

    def __call__(self, features):
        if self.cache is None:
            raise FeatureCacheError("CachedFeatureCollator needs cache=FeatureCache(...)")
        batch = super().__call__(features)
        ids, attn, anchors = batch["input_ids"], batch["attention_mask"], batch["anchor_positions"]
        bsz, width = ids.shape
        meta = self.cache.meta
        m_h = len(meta["target_layer_ids"]) * meta["hidden_size"]
        feats = torch.zeros((bsz, width, m_h), dtype=torch.bfloat16)
        last = torch.zeros((bsz, width, meta["hidden_size"]), dtype=torch.bfloat16)
        lse = torch.full((bsz, width), float("inf"), dtype=torch.float32)
        for b, f in enumerate(features):
            if "idx" not in f:
                raise FeatureCacheError("CachedFeatureCollator needs an `idx` column (prepare_dataset adds it)")
            full = f["input_ids"]
            full = full.tolist() if hasattr(full, "tolist") else list(full)
            if self.max_length is not None:
                full = full[: self.max_length]
            n = int(attn[b].sum())
            fe, la, ls = self.cache.row(int(f["idx"]), full, n)
            feats[b, :n], last[b, :n], lse[b, :n] = fe, la, ls
        gamma = self.block_size
        batch["context_features"] = feats
        batch["slot_hidden"] = gather_slots(last, anchors, gamma)
        batch["slot_lse"] = gather_slots(lse, anchors, gamma).nan_to_num(float("inf"))
        return batch
