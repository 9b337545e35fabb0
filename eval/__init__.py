"""The evaluation scripts of hf_plookup, one measurement each; their shared code is `eval.lib`.

A package (declared in pyproject.toml) so that the editable install makes `eval.lib` importable
whichever way a script starts: `python eval/bench.py ...` or `python -m eval.bench ...` from the
repository root, with no path set-up in the scripts."""
