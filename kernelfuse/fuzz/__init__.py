"""Differential fuzzing (`kernelfuse fuzz`): random valid models, rendered as problem files, run through the
pipeline and checked against eager; failures shrunk to minimal problem files."""
