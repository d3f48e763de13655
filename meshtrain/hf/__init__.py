"""Hugging Face Llama checkpoints: config mapping (`config`), tensor names and
layouts (`weights`), sharded reading onto a mesh (`load`), `import-hf` and
`config.init_from` (`importer`), and `export-hf` (`exporter`)."""
