"""The tracking seam: the only package that talks to MLflow (`tracking.runs`) and publishes results
(`tracking.reporting`: result tables as markdown/CSV and Prefect artifacts). Every other module calls these."""

from tracking.redaction import install_redaction

install_redaction()  # every process that tracks anything masks credentials in its logs and MLflow's errors
