"""``fastchain doctor`` and ``fastchain.report()``: what this machine offers."""
