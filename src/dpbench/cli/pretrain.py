"""``dpbench pretrain``: a public pretraining recipe trained into a verified checkpoint
(``dpbench.training.pretrain``)."""

from __future__ import annotations

import hashlib

from dpbench import log
from dpbench.cli.arguments import check_output, positive_float

_LOG = log.get(__name__)


def add_parsers(sub) -> None:
    p = sub.add_parser("pretrain", help="train a language model non-privately on a public corpus (the private "
                                        "text removed); writes the checkpoint and its JSON sidecar")
    p.add_argument("--recipe", required=True, help="wordnet-lm, tiny, or a JSON object of recipe fields "
                                                   "(dpbench.training.recipes.Recipe)")
    p.add_argument("--out", required=True, help="the checkpoint (a torch state_dict); the sidecar goes to OUT.json, "
                                                "the resume file of an unfinished run to OUT.resume")
    p.add_argument("--data-dir", help="where to look first for wordnet/ and fortunes/")
    p.add_argument("--expect", metavar="KEY-CODE", help="refuse unless the recipe's key and the code fingerprint "
                                                        "are these (the workflow names its file by them)")
    p.add_argument("--reuse", metavar="DIR",
                   help="copy DIR's checkpoint of this exact name (recipe key and code fingerprint) and its sidecar "
                        "to --out instead of training, once they verify; a damaged or stale one there is refused, "
                        "naming it; none there: train")
    p.add_argument("--progress-every", type=positive_float, default=10.0, help="seconds between progress lines")
    p.add_argument("--checkpoint-every", type=positive_float, default=60.0,
                   help="seconds between writes of the resume file")
    p.set_defaults(func=cmd_pretrain)


def cmd_pretrain(args) -> int:
    from dpbench.pipeline.fingerprint import pretrain_fingerprint
    from dpbench.training.recipes import get_recipe

    recipe = get_recipe(args.recipe)
    code = pretrain_fingerprint()
    actual = f"{recipe.key}-{code}"
    if args.expect and args.expect != actual:
        raise ValueError(f"argument --expect: recipe {recipe.name} with this code is {actual}, not {args.expect}")
    check_output(args.out, "--out")
    if args.reuse is not None and reuse(args.reuse, recipe, code, args.out):
        return 0
    from dpbench.training.pretrain import pretrain

    record = pretrain(recipe, args.out, args.data_dir, code=code, progress_every_s=args.progress_every,
                      checkpoint_every_s=args.checkpoint_every)
    overlap = record["overlap"]
    _LOG.info(f"wrote {args.out} and {args.out}.json: recipe {recipe.name} ({recipe.key}), held-out loss "
              f"{record['validation']['loss']:.4f} nats/token; removed {overlap['removed']} of "
              f"{overlap['public_records']} public records sharing text with fortunes")
    return 0


def reuse(directory: str, recipe, code: str, out: str) -> bool:
    """Copies ``directory``'s checkpoint of the name the workflow gives this recipe under this
    code (``checkpoint_name``), with its sidecar, to ``out`` and ``out.json``, where it verifies
    (``load_pretrained``: its SHA-256 against its sidecar, the recipe's key, the code's
    fingerprint); True where it did. No such file: False (the caller trains). A file of that name
    that does not verify is refused, naming it (ValueError): nobody retrains believing they reused."""
    from pathlib import Path

    from dpbench.files import atomic_write
    from dpbench.training.pretrain import load_pretrained
    from dpbench.training.recipes import checkpoint_name

    committed = Path(directory) / checkpoint_name(recipe, code)
    if not committed.is_file():
        _LOG.info(f"pretrain {recipe.name}: no committed checkpoint {committed}; training")
        return False
    try:
        loaded = load_pretrained(committed, expected=recipe, code=code)
    except ValueError as exc:
        raise ValueError(f"argument --reuse: {exc}; remove it to train afresh") from None
    data, sidecar = committed.read_bytes(), Path(f"{committed}.json").read_bytes()
    if hashlib.sha256(data).hexdigest() != loaded.record["sha256"]:  # changed between the check and the read
        raise ValueError(f"argument --reuse: {committed} changed while it was read")
    atomic_write(Path(out), lambda f: f.write(data))
    atomic_write(Path(f"{out}.json"), lambda f: f.write(sidecar))
    _LOG.info(f"pretrain {recipe.name}: reused {committed} (sha256 {loaded.record['sha256'][:16]}..., recipe "
              f"{recipe.key}, code {code}, verified): copied to {out} and {out}.json; no training")
    return True
