"""Speed and quality measurement of the runtime: timing, the benchmark run, sweeps, its report."""
