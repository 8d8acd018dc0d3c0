# One rule per figure the config asks for (config key `figures`), each with its own caption (a
# plugin's figure: one caption for all, naming its rule): figures write <name>.png and .pdf, tables
# (FigureSpec.kind == "table") <name>.md, <name> the entry's (its figure id, or its own name with
# option `figure: <id>`, a second drawing); the first file goes into the report and is the one
# `dpbench plot --out` names.
from dpbench.pipeline import catalog

for _figure in FIGURES:  # a figures entry: its name names the rule and files, _id the figure drawn
    _id = JOBS.figure_id(_figure)
    _files = JOBS.figure_files(_figure)
    _caption = "plugin_figure" if catalog.is_plugin("figures", _id) else _id
    _table = _files[0].endswith(".md")
    # the main file first and by name (the command names it: a shell string is formatted when
    # the job runs, after this loop has moved on, so it must not name a variable of the loop)
    _outputs = {"main": report(_files[0], caption=f"../report/{_caption}.rst",
                               category="Tables" if _table else "Figures"),
                **{path.rpartition(".")[2]: path for path in _files[1:]}}

    rule:
        name:
            f"plot_{_figure}"
        input:
            runs=figure_input(_figure),
        output:
            **_outputs,
        log:
            f"{RESULTS}/logs/plot/{_figure}.log",
        params:
            dpbench=DPBENCH,
            figure=_id,
            options=figure_options(_figure),
            code=fingerprint.figure_fingerprint(_id),
        localrule: True
        conda:
            ENVS["analysis"]
        shell:
            "{params.dpbench} plot {params.figure} --runs {input.runs:q} --out {output.main:q} {params.options} > {log:q} 2>&1"
