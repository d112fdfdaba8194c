"""Helpers of the validation and comparison commands in ``experiments/`` (not commands
themselves): the validation's config and saturation search, compare_policies' checks, and the
published tables' length models."""
