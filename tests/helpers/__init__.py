"""Test helpers shared by every test folder: layouts of groups, fp64 precision promotion, two-rank runs."""
