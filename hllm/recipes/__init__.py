"""Recipes: leaves, each one file with a `main()` over the library (the single-process job, the real-text students,
LoRA over cached prefix states), run by the `hllm` command or `python -m hllm.recipes.NAME`. Nothing in the library imports
them (tests/test_purity.py)."""
