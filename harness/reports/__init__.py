"""What the harness prints and writes from runs: the run summary, paper-style tables with
published numbers and paired tests, statistics, explanation figures and tables."""
