"""draftsmith.drafters"""
