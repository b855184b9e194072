"""Target-model runtimes behind one small interface (`base.TargetBackend`)."""
