"""Prompt-layout linter and cache-miss explainer: why a prefix did not hit, and how to fix it."""
