"""Operating the pipeline: the `cse` command line (`cse.ops.cli`) and the Prefect server's automations (`cse.ops.automations`)."""
