"""Operating the pipeline: the `cse` command line (`cse.ops.cli`) the Prefect server's automations (`cse.ops.automations`) and its setup (`cse.ops.prefect_setup`)."""

from cse import refuse_bare_name

refuse_bare_name(__name__)
