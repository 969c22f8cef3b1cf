"""Evaluation: IR metrics (trec_eval-exact through ir-measures), the student's and teacher's reports and TREC run
files. Imports `hllm.reranker` and below."""
