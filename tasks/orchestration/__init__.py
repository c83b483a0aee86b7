"""The Airflow glue shared by the DAG files, and task logs for `dag.test()` runs."""
