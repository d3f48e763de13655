"""Hugging Face Llama checkpoints: config mapping (`config`), tensor names and
layouts (`weights`), import onto a mesh (`load`) and export (`export`)."""
