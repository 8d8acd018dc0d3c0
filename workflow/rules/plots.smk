# One rule per figure the config asks for (config key `figures`), each with its own caption.
for _figure in FIGURES:

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
