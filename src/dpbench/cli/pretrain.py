"""``dpbench pretrain``: a public pretraining recipe trained into a verified checkpoint
(``dpbench.training.pretrain``)."""

from __future__ import annotations

import sys

from dpbench.cli.arguments import check_output, positive_float


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
    from dpbench.training.pretrain import pretrain

    record = pretrain(recipe, args.out, args.data_dir, code=code, progress_every_s=args.progress_every,
                      checkpoint_every_s=args.checkpoint_every)
    overlap = record["overlap"]
    print(f"wrote {args.out} and {args.out}.json: recipe {recipe.name} ({recipe.key}), held-out loss "
          f"{record['validation']['loss']:.4f} nats/token; removed {overlap['removed']} of "
          f"{overlap['public_records']} public records sharing text with fortunes", file=sys.stderr)
    return 0
