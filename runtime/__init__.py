"""draftsmith.runtime"""
