# One rule per figure the config asks for (config key `figures`), each with its own caption (a
# plugin's figure: one caption for all, naming its rule): figures write <id>.png and .pdf, tables
# (FigureSpec.kind == "table") <id>.md; the first file goes into the report and is the one
# `dpbench plot --out` names.
from dpbench.pipeline import catalog

for _figure in FIGURES:
    _files = JOBS.figure_files(_figure)
    _caption = "plugin_figure" if catalog.is_plugin("figures", _figure) else _figure
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
            figure=_figure,
            options=figure_options(_figure),
            code=fingerprint.figure_fingerprint(_figure),
        localrule: True
        conda:
            ENVS["analysis"]
        shell:
            "{params.dpbench} plot {params.figure} --runs {input.runs:q} --out {output.main:q} {params.options} > {log:q} 2>&1"
