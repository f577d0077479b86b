"""Operating the pipeline: the `cse` command line (`cse.ops.cli`) the Prefect server's automations (`cse.ops.automations`) and its setup (`cse.ops.prefect_setup`)."""
