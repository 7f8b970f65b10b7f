"""What users run over the layers below: multi-target builds, validation, conformance, comparison, reports, traces."""
