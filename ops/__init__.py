"""Operating the pipeline: the `cse` command line (`ops.cli`) and the Prefect server's automations (`ops.automations`)."""
