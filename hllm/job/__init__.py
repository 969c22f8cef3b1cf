"""The job's library: its typed config (`config`), its stages as plain Python (`stages`: teacher rankings, the
student's fit, the evaluation, the summary), the ablation grid (`ablations`), reranking a whole collection
(`collection`, behind `hllm rerank`) and the flywheel's refresh steps (`refresh`). `pipelines/` runs them on Ray;
`hllm.recipes.local_job` runs them in one process."""
