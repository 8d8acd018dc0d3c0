# One rule per figure the config asks for (config key `figures`), each with its own caption:
# figures write <id>.png and .pdf, tables (FIGURES[id].kind == "table") <id>.md.
from dpbench.reporting.figures import FIGURES as _FIGURE_SPECS  # noqa: E402

for _figure in FIGURES:

    if _FIGURE_SPECS[_figure].kind == "table":

        rule:
            name:
                f"plot_{_figure}"
            input:
                runs=figure_input(_figure),
            output:
                md=report(
                    f"{RESULTS}/figures/{_figure}.md",
                    caption=f"../report/{_figure}.rst",
                    category="Tables",
                ),
            log:
                f"{RESULTS}/logs/plot/{_figure}.log",
            params:
                dpbench=DPBENCH,
                figure=_figure,
                options=figure_options(_figure),
                code=figure_fingerprint(_figure),
            localrule: True
            conda:
                ENVS["analysis"]
            shell:
                "{params.dpbench} plot {params.figure} --runs {input.runs} --out {output.md} "
                "{params.options} > {log} 2>&1"

    else:

        rule:
            name:
                f"plot_{_figure}"
            input:
                runs=figure_input(_figure),
            output:
                png=report(
                    f"{RESULTS}/figures/{_figure}.png",
                    caption=f"../report/{_figure}.rst",
                    category="Figures",
                ),
                pdf=f"{RESULTS}/figures/{_figure}.pdf",
            log:
                f"{RESULTS}/logs/plot/{_figure}.log",
            params:
                dpbench=DPBENCH,
                figure=_figure,
                options=figure_options(_figure),
                code=figure_fingerprint(_figure),
            localrule: True
            conda:
                ENVS["analysis"]
            shell:
                "{params.dpbench} plot {params.figure} --runs {input.runs} --out {output.png} "
                "{params.options} > {log} 2>&1"
