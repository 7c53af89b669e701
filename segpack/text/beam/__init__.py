"""Tokenizing on Apache Beam: `segpack tokenize --runner beam` (docs/ingest.md, segpack[beam]).

Modules: `pipeline` (the pipeline's steps and `write_dataset_beam`), `driver` (the driver's side:
the output directory before the run, Beam's options and local runner, the errors and counters
after it), `remote_inputs` (inputs and tokenizer files named by URL), `remote` (a run whose
inputs, output or tokenizer file is a URL). Apache Beam is imported when a pipeline runs
(`driver.import_beam`), not when these modules are.
"""
