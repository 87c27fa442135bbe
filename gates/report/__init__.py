"""The gate's reports: gate.json's Markdown summary for CI logs and PR comments, and its HTML
page.
"""
