"""all-MiniLM-L6-v2 on P6's records, the facts that size P7: the records' token lengths under
its tokenizer (percentiles, to choose the maximum length), the wall time of one forward pass of
L records cut to a length, and (a non-private sanity check) the validation accuracy of a
logistic regression on the frozen encoder's pooled features of training records, beside always
answering the largest class.

The encoder is the catalogued package (``dpbench.problems.encoders.locate``: its files checked
against upstream's SHA-256), read offline with transformers; the records are P6's (the fortunes
corpus, its hash split, each labelled with its file). The regression is scikit-learn's
(multinomial, L2, C chosen by 5-fold cross-validation on the training features only), fitted
on ``--probe-records`` training records drawn at random (seed 0; each count in turn, the
smaller sets inside the larger).

Usage:  python benchmarks/bench_encoder.py [--threads 2] [--lot 32] [--max-length 128]
            [--repeats 10] [--probe-records 1400,3000,12979]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
import warnings

import numpy as np
import torch

from dpbench.data import fortunes
from dpbench.problems import encoders
from dpbench.problems.encoder_model import EncoderClassifier, encode, load_encoder
from dpbench.problems.text_classification import CLASSES, labels


def token_lengths(tokenizer, texts) -> np.ndarray:
    """Tokens per record with [CLS] and [SEP], untruncated."""
    ids = tokenizer(list(texts), add_special_tokens=True, truncation=False, return_attention_mask=False,
                    return_token_type_ids=False)["input_ids"]
    return np.array([len(i) for i in ids])


def features(model, tokenizer, texts, max_length: int, batch: int = 64) -> np.ndarray:
    """Pooled features of ``texts``, computed in batches of records of similar lengths (less
    padding; the masked pooling makes a record's features independent of its batch)."""
    order = np.argsort(token_lengths(tokenizer, texts), kind="stable")
    out = np.empty((len(texts), model.head.in_features), dtype=np.float32)
    with torch.no_grad():
        for start in range(0, len(texts), batch):
            rows = order[start:start + batch]
            out[rows] = model.features(encode(tokenizer, [texts[i] for i in rows], max_length)).numpy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lot", type=int, default=32, help="records per forward pass (L)")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--probe-records", default="1400,3000,12979",
                        help="training records the probe is fitted on, comma-separated (0: no probe)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, {args.threads} threads")

    loaded = load_encoder(encoders.locate(encoders.MINILM.name))
    corpus = fortunes.load()
    train, validation = list(corpus.train), list(corpus.validation)
    print(f"records: train {len(train)}, validation {len(validation)}")

    lengths = token_lengths(loaded.tokenizer, train)
    q = np.percentile(lengths, [50, 90, 95, 99])
    print(f"MiniLM tokens per training record (with [CLS], [SEP]): p50 {q[0]:.0f}, p90 {q[1]:.0f}, p95 {q[2]:.0f}, "
          f"p99 {q[3]:.0f}, max {lengths.max()}, mean {lengths.mean():.1f}")
    for cut in (64, 96, 128, 256):
        print(f"  cut at {cut}: {np.mean(lengths > cut):.1%} of records lose tokens")

    torch.manual_seed(0)
    model = EncoderClassifier.from_loaded(loaded, len(CLASSES)).eval()
    for length in sorted({32, 64, args.max_length}):
        # L records at least `length` tokens long, cut to it: one forward pass of a full-width batch
        tokens = encode(loaded.tokenizer, [t for t, n in zip(train, lengths) if n >= length][:args.lot], length)
        assert tokens.shape == (args.lot, length), tokens.shape
        with torch.no_grad():
            for _ in range(2):
                model(tokens)
            times, cpu = [], []
            for _ in range(args.repeats):
                t, c = time.perf_counter(), time.process_time()
                model(tokens)
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
        print(f"forward pass, L = {args.lot} records x {length} tokens, no gradient: median "
              f"{statistics.median(times) * 1e3:.0f} ms wall (range {min(times) * 1e3:.0f}-{max(times) * 1e3:.0f}), "
              f"{statistics.median(cpu) * 1e3:.0f} ms CPU, {args.repeats} repeats")

    counts = sorted(int(n) for n in args.probe_records.split(",") if int(n) > 0)
    if not counts:  # --probe-records 0: the lengths and timings only
        return
    from sklearn.linear_model import LogisticRegressionCV

    # the training records in a seeded random order (the corpus's own order is file by file): the
    # probe on n records is fitted on the first n of it
    chosen = np.random.default_rng(0).permutation(len(train))[:counts[-1]]
    y_train, y_val = labels(corpus.train_files)[chosen], labels(corpus.validation_files)
    t = time.perf_counter()
    x_train = features(model, loaded.tokenizer, [train[i] for i in chosen], args.max_length)
    x_val = features(model, loaded.tokenizer, validation, args.max_length)
    print(f"frozen features of {len(x_train) + len(x_val)} records at max length {args.max_length}: "
          f"{time.perf_counter() - t:.0f} s")
    for n in counts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # scikit-learn 1.9's notice of renamed attributes
            probe = LogisticRegressionCV(Cs=8, cv=5, max_iter=2000).fit(x_train[:n], y_train[:n])
        largest = np.bincount(y_train[:n], minlength=len(CLASSES)).argmax()
        print(f"logistic regression on frozen pooled features of {n} training records: validation accuracy "
              f"{probe.score(x_val, y_val):.3f} (C = {float(probe.C_[0]):.3g}); always the largest class "
              f"({CLASSES[largest]}): {np.mean(y_val == largest):.3f}")

if __name__ == "__main__":
    main()
