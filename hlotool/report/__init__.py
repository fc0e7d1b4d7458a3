"""What the user sees: terminal tables, the versioned JSON documents, the HTML diff report
with its pictures, and the cost report and plot. The top of the data flow: it imports every
stage below and nothing imports it but the CLI."""
