rule plot_best_accuracy:
    input:
        rules.aggregate.output.runs,
    output:
        report(
            f"{RESULTS}/figures/best_accuracy.png",
            caption="../report/best_accuracy.rst",
            category="Optimizer comparison",
        ),
    log:
        f"{RESULTS}/logs/plot_best_accuracy.log",
    params:
        dpbench=DPBENCH,
    conda:
        ENV
    shell:
        "{params.dpbench} plot --runs {input} --out {output} > {log} 2>&1"
