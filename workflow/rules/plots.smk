# One rule per figure the config asks for (config key `figures`), each with its own caption (a
# plugin's figure: one caption for all, naming its rule): figures write <id>.png and .pdf, tables
# (FigureSpec.kind == "table") <id>.md; the first file goes into the report and is the one
# `dpbench plot --out` names.
from dpbench.reporting.figures import FIGURES as FIGURE_SPECS

for _figure in FIGURES:
    _files = JOBS.figure_files(_figure)
    _main = _files[0].rpartition(".")[2]
    _outputs = {path.rpartition(".")[2]: path for path in _files}
    _caption = "plugin_figure" if FIGURE_SPECS.plugin(_figure) else _figure
    _outputs[_main] = report(_files[0], caption=f"../report/{_caption}.rst",
                             category="Tables" if _main == "md" else "Figures")

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
            # output[0]: the main file (the shell string is formatted when the job runs, after
            # this loop has rebound _main: a name of the loop must not appear in it)
            "{params.dpbench} plot {params.figure} --runs {input.runs} --out {output[0]} {params.options} > {log} 2>&1"
