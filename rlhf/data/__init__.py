"""Data: sources (embedded task, files, Hub), TRL dataset formats, tokenization and collation. May import
``rlhf.core`` only."""
